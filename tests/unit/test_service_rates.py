"""A worker's two measured rates (workers/service_rates.py)."""

from __future__ import annotations

import pytest

from workers.service_rates import ServiceRates


def test_no_pass_measures_no_rate() -> None:
    rates = ServiceRates()
    assert rates.items_per_s() == 0.0
    assert rates.backlog_items_per_s() == 0.0


def test_the_service_rate_counts_model_seconds_and_the_backlog_rate_wall_seconds() -> None:
    rates = ServiceRates()
    for _ in range(10):
        rates.stored(1, 0.02)  # single jobs: 50 a model-second
    for _ in range(4):
        rates.stored(32, 0.2)
        rates.drained(32, 0.25)  # a backlog's passes, 50 ms between them on top of the model's 200
    assert rates.items_per_s() == pytest.approx((10 + 128) / (0.2 + 0.8))
    assert rates.backlog_items_per_s() == pytest.approx(128 / 1.0)


def test_each_rate_follows_only_its_last_passes() -> None:
    rates = ServiceRates(window=4)
    for _ in range(4):
        rates.stored(1, 1.0)
        rates.drained(1, 1.0)
    for _ in range(4):
        rates.stored(10, 1.0)
        rates.drained(20, 1.0)
    assert rates.items_per_s() == pytest.approx(10.0)
    assert rates.backlog_items_per_s() == pytest.approx(20.0)
