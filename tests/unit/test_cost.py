"""The cost arithmetic (sluice/cost.py) and `/stats`' cost summary over samples (sluice/stats.py)."""

from __future__ import annotations

import pytest

from sluice.cost import PassUsage, Prices, cost_per_1k_jobs, padding_ratio, pass_tokens
from sluice.stats import summarise, summarise_cost
from sluice.wire.samples import Sample


def test_pass_tokens_pads_each_pass_to_its_longest() -> None:
    lengths = [10, 200, 12, 20]
    # One pass: 4 x 200 computed for 242 real; two passes: 3 x 20 + 1 x 200.
    assert pass_tokens(lengths, [[0, 1, 2, 3]]) == (800, 242)
    assert pass_tokens(lengths, [[0, 2, 3], [1]]) == (260, 242)
    assert pass_tokens(lengths, []) == (0, 0)


def test_padding_ratio_without_tokens_is_unknown() -> None:
    assert padding_ratio(padded_tokens=800, real_tokens=200) == 4.0
    assert padding_ratio(padded_tokens=0, real_tokens=0) is None


def test_a_pass_is_charged_its_model_time_and_the_idle_time_before_it() -> None:
    usage = PassUsage(padded_tokens=1, real_tokens=1, busy_s=0.5, idle_s=1.5, cores=2, gpus=1)
    assert usage.core_s == 4.0 and usage.gpu_s == 2.0


def test_cost_per_1k_jobs() -> None:
    # 3600 core-seconds = 1 core-hour at 0.05, plus 360 GPU-seconds = 0.1 GPU-hour at 2.0: 0.25 for
    # 500 jobs, so 0.5 per 1,000.
    prices = Prices(per_core_hour=0.05, per_gpu_hour=2.0)
    assert cost_per_1k_jobs(core_s=3600, gpu_s=360, jobs=500, prices=prices) == pytest.approx(0.5)
    # A CPU-only version needs no GPU price.
    assert cost_per_1k_jobs(core_s=3600, gpu_s=0, jobs=1000, prices=Prices(per_core_hour=0.05)) == pytest.approx(0.05)


@pytest.mark.parametrize(("core_s", "gpu_s", "jobs", "prices"), [
    (3600, 0, 1000, Prices()),  # no price configured
    (3600, 360, 1000, Prices(per_core_hour=0.05)),  # a GPU was used and has no price
    (3600, 0, 0, Prices(per_core_hour=0.05)),  # no jobs
    (0, 0, 1000, Prices(per_core_hour=0.05)),  # nothing measured
])
def test_an_unknown_cost_is_none_not_zero(core_s: float, gpu_s: float, jobs: int, prices: Prices) -> None:
    assert cost_per_1k_jobs(core_s=core_s, gpu_s=gpu_s, jobs=jobs, prices=prices) is None


def _sample(**share: float) -> Sample:
    return Sample(status="succeeded", finished_at=100.0, queue_wait_ms=1.0, model_ms=2.0, total_ms=3.0, batch_size=2,
                  close_reason="size", **share)  # type: ignore[arg-type]


def test_stats_sums_the_jobs_shares_of_their_passes() -> None:
    # Two passes of two jobs: (padded 400, real 100, 2 core-s incl. 1 idle) and (padded 40, real 40, 2 core-s).
    first = dict(padded_tokens=200.0, real_tokens=50.0, core_s=1.0, idle_s=0.5, fill_ms=4.0)
    second = dict(padded_tokens=20.0, real_tokens=20.0, core_s=1.0, fill_ms=8.0)
    samples = [_sample(**first), _sample(**first), _sample(**second), _sample(**second)]
    cost = summarise_cost(samples, Prices(per_core_hour=3.6))
    assert cost["padded_tokens"] == 440 and cost["real_tokens"] == 140
    assert cost["padding_ratio"] == pytest.approx(440 / 140, abs=1e-4)
    assert cost["idle_slot_s"] == 1.0 and cost["core_s"] == 4.0 and cost["gpu_s"] == 0.0
    # 4 core-seconds at 3.6 an hour is 0.004 for 4 jobs: 1.0 per 1,000.
    assert cost["per_1k_jobs"] == pytest.approx(1.0)
    stats = summarise(samples, window_s=60.0)
    assert stats["cost"]["per_1k_jobs"] is None and stats["cost"]["price_per_core_hour"] == 0.0
    assert stats["fill_ms"]["p50"] == 6.0


def test_samples_without_the_shares_read_as_unmeasured() -> None:
    cost = summarise_cost([_sample()], Prices(per_core_hour=1.0))
    assert cost["padding_ratio"] is None and cost["per_1k_jobs"] is None


def test_the_shares_round_trip_through_the_sample_codec() -> None:
    sample = _sample(padded_tokens=12.5, real_tokens=3.25, core_s=0.125, gpu_s=0.0625, idle_s=0.5, fill_ms=7.0)
    fields = {key.encode(): value.encode() for key, value in sample.to_fields().items()}
    assert Sample.from_fields(fields) == sample
    assert "pt" not in _sample().to_fields()
