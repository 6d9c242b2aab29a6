"""`/stats/series` (sluice/stats.py `series`): samples bucketed over time on a fixed grid, each
bucket's percentiles exact, on a fixed clock."""

from __future__ import annotations

import numpy as np
import pytest

from sluice.stats import MAX_SERIES_BUCKETS, SERIES_P99_MIN_SAMPLES, series
from sluice.wire.samples import Sample

NOW = 1_000_007.5  # 7.5 s into the step that starts at 1_000_005 (steps of 5 s)


def sample(finished_at: float, *, wait: float = 1.0, model: float = 2.0, status: str = "succeeded",
           batch_size: int = 1) -> Sample:
    return Sample(status=status, finished_at=finished_at, queue_wait_ms=wait, model_ms=model,
                  total_ms=wait + model, batch_size=batch_size, close_reason="age")


def test_buckets_sit_on_the_step_grid_and_leave_out_the_one_in_progress() -> None:
    result = series([], now=NOW, window_s=30.0, step_s=5.0)
    assert (result["since"], result["until"]) == (1_000_000.0 - 25.0, 1_000_005.0)
    assert [b["t"] for b in result["buckets"]] == [999_975.0 + 5 * i for i in range(6)]
    # A poll a few seconds later, within the same step, draws the same buckets.
    assert series([], now=NOW + 2.4, window_s=30.0, step_s=5.0)["buckets"] == result["buckets"]


def test_an_empty_bucket_has_no_latency_rather_than_zero() -> None:
    [bucket] = series([], now=NOW, window_s=5.0, step_s=5.0)["buckets"]
    assert bucket["count"] == 0 and bucket["errors"] == 0 and bucket["throughput_per_s"] == 0.0
    assert bucket["error_rate"] is None and bucket["batch_size_mean"] is None
    assert bucket["queue_wait_ms"] == {"p50": None, "p95": None, "p99": None}
    assert bucket["model_ms"] == {"p50": None, "p95": None, "p99": None}


def test_each_sample_lands_in_the_bucket_of_its_finish_time() -> None:
    samples = [
        sample(999_994.0),                      # before the window: ignored
        sample(999_995.0, wait=10.0),           # the first bucket's first instant
        sample(999_999.99, wait=20.0),          # its last
        sample(1_000_000.0, wait=30.0, status="failed"),
        sample(1_000_004.999, wait=40.0),
        sample(1_000_005.0),                    # the bucket in progress: not reported yet
        sample(1_000_007.0),
    ]
    first, second = series(samples, now=NOW, window_s=10.0, step_s=5.0)["buckets"]
    assert (first["t"], first["count"], first["errors"], first["error_rate"]) == (999_995.0, 2, 0, 0.0)
    assert (second["t"], second["count"], second["errors"], second["error_rate"]) == (1_000_000.0, 2, 1, 0.5)
    assert first["queue_wait_ms"]["p50"] == 15.0 and second["queue_wait_ms"]["p50"] == 35.0
    assert first["throughput_per_s"] == second["throughput_per_s"] == 0.4


def test_percentiles_are_exact_per_bucket_and_p99_needs_its_floor() -> None:
    rng = np.random.default_rng(7)
    full = rng.exponential(20.0, SERIES_P99_MIN_SAMPLES)
    short = rng.exponential(20.0, SERIES_P99_MIN_SAMPLES - 1)
    samples = [sample(999_990.0 + i / len(full), wait=float(w), model=float(w) / 2) for i, w in enumerate(full)]
    samples += [sample(999_995.0 + i / len(short), wait=float(w)) for i, w in enumerate(short)]
    first, second, third = series(samples, now=NOW, window_s=15.0, step_s=5.0)["buckets"]
    for name, values in (("queue_wait_ms", full), ("model_ms", full / 2)):
        expected = np.percentile(values, [50, 95, 99], method="linear")
        assert first[name] == {"p50": round(float(expected[0]), 3), "p95": round(float(expected[1]), 3),
                               "p99": round(float(expected[2]), 3)}
    assert second["count"] == SERIES_P99_MIN_SAMPLES - 1
    assert second["queue_wait_ms"]["p99"] is None and second["queue_wait_ms"]["p95"] is not None
    assert third["count"] == 0


def test_the_batch_mean_counts_batches_not_jobs() -> None:
    # One batch of 4 (four samples) and two batches of 1: 6 jobs in 3 batches.
    samples = [sample(1_000_001.0, batch_size=4) for _ in range(4)] + [sample(1_000_002.0), sample(1_000_003.0)]
    [bucket] = series(samples, now=NOW, window_s=5.0, step_s=5.0)["buckets"]
    assert bucket["batch_size_mean"] == 2.0


@pytest.mark.parametrize(("window_s", "step_s"), [(4.0, 5.0), (10.0, 0.0), (10.0, -1.0),
                                                  (MAX_SERIES_BUCKETS * 5.0 + 5.0, 5.0)])
def test_a_window_of_no_step_or_too_many_is_refused(window_s: float, step_s: float) -> None:
    with pytest.raises(ValueError, match="steps"):
        series([], now=NOW, window_s=window_s, step_s=step_s)


def test_the_most_buckets_allowed() -> None:
    result = series([], now=NOW, window_s=MAX_SERIES_BUCKETS * 5.0, step_s=5.0)
    assert len(result["buckets"]) == MAX_SERIES_BUCKETS
