"""Per-version statistics over the finished-job samples (`sluice.samples`).

Percentiles are exact over the window's samples (numpy's default 'linear' method, i.e.
Hyndman-Fan type 7), not estimates from histogram buckets. A p99 needs P99_MIN_SAMPLES of them:
below that it is null, and `count` says how many there were.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from sluice.jobs import CLOSE_REASONS
from sluice.quality import summarise_quality
from sluice.samples import Sample

# DESIGN §9: a p99 of fewer than a few hundred samples is not reported as one. Of 100 samples it
# is an interpolation between the two largest, so it says little more than the maximum does.
P99_MIN_SAMPLES = 300


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None, "p99": None}
    p50, p95, p99 = np.percentile(np.asarray(values), [50, 95, 99], method="linear")
    return {"p50": round(float(p50), 3), "p95": round(float(p95), 3),
            "p99": round(float(p99), 3) if len(values) >= P99_MIN_SAMPLES else None}


def summarise(samples: list[Sample], *, window_s: float) -> dict[str, Any]:
    count = len(samples)
    errors = sum(1 for s in samples if s.status != "succeeded")
    span = (max(s.finished_at for s in samples) - min(s.finished_at for s in samples)) if count > 1 else 0.0
    sizes = Counter(s.batch_size for s in samples)
    # Samples are per job, so a batch of n appears n times: weigh each by 1/n to count batches.
    batches: dict[str, float] = {}
    for s in samples:
        batches[s.close_reason] = batches.get(s.close_reason, 0.0) + 1.0 / max(1, s.batch_size)
    total_batches = sum(batches.values())
    return {
        "window_s": window_s,
        "count": count,
        "errors": errors,
        "error_rate": round(errors / count, 6) if count else 0.0,
        "throughput_per_s": round(count / span, 3) if span > 0 else 0.0,
        "queue_wait_ms": _percentiles([s.queue_wait_ms for s in samples]),
        "model_ms": _percentiles([s.model_ms for s in samples]),
        "total_ms": _percentiles([s.total_ms for s in samples]),
        "batch_size": {
            "mean": round(count / total_batches, 3) if total_batches else 0.0,
            "histogram": {str(size): round(n / size) for size, n in sorted(sizes.items())},
        },
        "close_reasons": {reason: round(batches.get(reason, 0.0)) for reason in CLOSE_REASONS},
        "quality": summarise_quality(s.quality for s in samples),
        "percentile_method": "exact, linear interpolation (type 7)",
        "p99_min_samples": P99_MIN_SAMPLES,
    }
