"""Per-version statistics over the finished-job samples (`sluice.wire.samples`).

Percentiles are exact over the window's samples (numpy's default 'linear' method, i.e.
Hyndman-Fan type 7), not estimates from histogram buckets. A p99 needs P99_MIN_SAMPLES of them:
below that it is null, and `count` says how many there were. `series` buckets the same samples
over time, with the same method and a lower bar per bucket (SERIES_P99_MIN_SAMPLES).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from sluice.cost import Prices, cost_per_1k_jobs, padding_ratio
from sluice.quality import summarise_quality
from sluice.vocabulary import CLOSE_REASONS
from sluice.wire.samples import Sample

# A p99 of fewer than a few hundred samples is not reported as one. Of 100 samples it
# is an interpolation between the two largest, so it says little more than the maximum does.
P99_MIN_SAMPLES = 300


def percentiles(values: Sequence[float], qs: Sequence[float] = (50, 95, 99), *,
                p99_min: int = P99_MIN_SAMPLES) -> dict[str, float | None]:
    """Exact percentiles (type 7), unrounded, keyed `p50`, `p99.9`...; None where there are no
    values, and for a p99 or higher from fewer than `p99_min`. The benchmarks report with it too,
    so their figures and `/stats` are computed alike."""
    data = np.asarray(values, dtype=float)
    return {f"p{q:g}": None if len(data) == 0 or (q >= 99 and len(data) < p99_min)
            else float(np.percentile(data, q, method="linear")) for q in qs}


def _percentiles(values: list[float], *, p99_min: int = P99_MIN_SAMPLES) -> dict[str, float | None]:
    return {key: None if value is None else round(value, 3)
            for key, value in percentiles(values, p99_min=p99_min).items()}


def summarise(samples: list[Sample], *, window_s: float, prices: Prices | None = None) -> dict[str, Any]:
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
        "fill_ms": _percentiles([s.fill_ms for s in samples]),
        "cost": summarise_cost(samples, prices or Prices()),
        "quality": summarise_quality(s.quality for s in samples),
        "percentile_method": "exact, linear interpolation (type 7)",
        "p99_min_samples": P99_MIN_SAMPLES,
    }


def summarise_cost(samples: Sequence[Sample], prices: Prices) -> dict[str, Any]:
    """The window's passes, from their jobs' shares (sluice/cost.py): padded ÷ real tokens, the
    idle slot seconds, core- and GPU-seconds charged, and what 1,000 jobs cost at `prices` (null:
    a price that is needed is not configured, or nothing was measured)."""
    padded = math.fsum(s.padded_tokens for s in samples)
    real = math.fsum(s.real_tokens for s in samples)
    core_s = math.fsum(s.core_s for s in samples)
    gpu_s = math.fsum(s.gpu_s for s in samples)
    ratio = padding_ratio(padded_tokens=padded, real_tokens=real)
    per_1k = cost_per_1k_jobs(core_s=core_s, gpu_s=gpu_s, jobs=len(samples), prices=prices)
    return {
        "padded_tokens": round(padded), "real_tokens": round(real),
        "padding_ratio": None if ratio is None else round(ratio, 4),
        "idle_slot_s": round(math.fsum(s.idle_s for s in samples), 3),
        "core_s": round(core_s, 3), "gpu_s": round(gpu_s, 3),
        "price_per_core_hour": prices.per_core_hour, "price_per_gpu_hour": prices.per_gpu_hour,
        "per_1k_jobs": None if per_1k is None else round(per_1k, 6),
    }


# --- over time ------------------------------------------------------------------------------------

# A bucket is a few seconds of one version's jobs, so the window's bar would hide the p99 line at
# all but high rates. At 100 a bucket's p99 sits near its maximum: read as a line beside its
# neighbours it still shows the tail moving; the window's figure (`summarise`) keeps the strict bar.
SERIES_P99_MIN_SAMPLES = 100
MAX_SERIES_BUCKETS = 1440


def check_series_window(*, window_s: float, step_s: float) -> None:
    """ValueError unless the window holds 1 to MAX_SERIES_BUCKETS steps."""
    if step_s <= 0 or window_s < step_s or window_s / step_s > MAX_SERIES_BUCKETS:
        raise ValueError(f"window_s ({window_s:g}) must hold 1 to {MAX_SERIES_BUCKETS} steps of step_s ({step_s:g})")


def series(samples: list[Sample], *, now: float, window_s: float, step_s: float) -> dict[str, Any]:
    """The samples bucketed by `finished_at` into steps of `step_s` over the last `window_s`, oldest
    bucket first: per bucket its start `t`, jobs, errors, rate and exact percentiles (as `summarise`).

    Buckets sit on multiples of `step_s` since the epoch, so two reads seconds apart put a job in
    the same bucket and a chart redrawn on each poll does not shift. Only complete buckets: the one
    in progress is left out, since its rate would read low until it ends (a chart would dip at its
    right edge on every poll), so the series ends at `until`, up to one step before `now`; a reader
    needs the samples of `window_s + step_s`. An empty bucket has count 0 and null percentiles,
    error rate and batch mean: no jobs is not zero latency. ValueError as `check_series_window`.
    """
    check_series_window(window_s=window_s, step_s=step_s)
    count = math.floor(window_s / step_s)
    until = math.floor(now / step_s) * step_s
    since = until - count * step_s
    buckets: list[list[Sample]] = [[] for _ in range(count)]
    for sample in samples:
        if since <= sample.finished_at < until:
            # Clamped: float rounding must not push a sample just below `until` out of the range.
            buckets[min(count - 1, int((sample.finished_at - since) // step_s))].append(sample)
    return {
        "window_s": window_s,
        "step_s": step_s,
        "since": since,
        "until": until,
        "buckets": [_bucket(since + i * step_s, bucket, step_s) for i, bucket in enumerate(buckets)],
        "percentile_method": "exact, linear interpolation (type 7)",
        "p99_min_samples": SERIES_P99_MIN_SAMPLES,
    }


def _bucket(t: float, samples: list[Sample], step_s: float) -> dict[str, Any]:
    count = len(samples)
    errors = sum(1 for s in samples if s.status != "succeeded")
    # As in `summarise`: a batch of n leaves n samples, so 1/n each counts batches.
    batches = sum(1.0 / max(1, s.batch_size) for s in samples)
    return {
        "t": t,
        "count": count,
        "errors": errors,
        "error_rate": round(errors / count, 6) if count else None,
        "throughput_per_s": round(count / step_s, 3),
        "queue_wait_ms": _percentiles([s.queue_wait_ms for s in samples], p99_min=SERIES_P99_MIN_SAMPLES),
        "model_ms": _percentiles([s.model_ms for s in samples], p99_min=SERIES_P99_MIN_SAMPLES),
        "batch_size_mean": round(count / batches, 3) if batches else None,
    }
