"""`/stats` percentiles (sluice/stats.py): exact, and no p99 from too few samples
(ARCHITECTURE, "Stats and quality")."""

from __future__ import annotations

import numpy as np
import pytest

from sluice.stats import P99_MIN_SAMPLES, summarise
from sluice.wire.samples import Sample


def samples(n: int) -> list[Sample]:
    # Spread-out, distinct values, so every percentile differs from its neighbours.
    return [
        Sample(
            status="succeeded",
            finished_at=100.0 + i,
            queue_wait_ms=float((i * 37) % n),
            model_ms=2.0 + i,
            total_ms=3.0 + i * 1.5,
            batch_size=1,
            close_reason="age",
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("n", [1, 10, 100, P99_MIN_SAMPLES - 1])
def test_under_the_floor_p99_is_null_and_the_count_says_why(n: int) -> None:
    stats = summarise(samples(n), window_s=300.0)
    assert stats["count"] == n and stats["p99_min_samples"] == P99_MIN_SAMPLES
    for series in ("queue_wait_ms", "model_ms", "total_ms"):
        assert stats[series]["p99"] is None, stats[series]
        assert stats[series]["p50"] is not None and stats[series]["p95"] is not None


@pytest.mark.parametrize("n", [P99_MIN_SAMPLES, 1000])
def test_from_the_floor_p99_is_exact(n: int) -> None:
    batch = samples(n)
    stats = summarise(batch, window_s=300.0)
    for series in ("queue_wait_ms", "model_ms", "total_ms"):
        values = np.asarray([getattr(s, series) for s in batch])
        assert stats[series]["p99"] == round(float(np.percentile(values, 99, method="linear")), 3)
        assert stats[series]["p50"] == round(float(np.percentile(values, 50, method="linear")), 3)


def test_no_samples_no_percentiles() -> None:
    stats = summarise([], window_s=300.0)
    assert stats["count"] == 0
    assert stats["total_ms"] == {"p50": None, "p95": None, "p99": None}
