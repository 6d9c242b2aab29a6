"""The autoscaling policy (scheduler/autoscale.py): replicas from leading signals, scale-down
stabilization and the arrival-rate tracker."""

from __future__ import annotations

import pytest

from scheduler.autoscale import (
    LaneLoad,
    PoolSignals,
    RateTracker,
    ScalingPolicy,
    Stabilizer,
    need,
)

IDLE = LaneLoad()
POLICY = ScalingPolicy(headroom=0.2, drain_target_s=30.0, stabilization_s=300.0, max_step_down=1)


def signals(*, online: LaneLoad = IDLE, bulk: LaneLoad = IDLE, service_rate: float | None = 10.0,
            cold_start_s: float | None = 20.0, live: int = 1, ready: int | None = None, min_replicas: int = 1,
            max_replicas: int = 10) -> PoolSignals:
    return PoolSignals(online=online, bulk=bulk, service_rate=service_rate, cold_start_s=cold_start_s, live=live,
                       ready=live if ready is None else ready, min_replicas=min_replicas, max_replicas=max_replicas)


def test_an_idle_version_keeps_its_floor() -> None:
    decided = need(signals(), POLICY)
    assert decided.replicas == 1
    assert "0.00 replicas, clamped to [1, 10]" in decided.reason


def test_the_rate_forecast_one_cold_start_ahead_sizes_the_pool() -> None:
    # 20 jobs/s now, rising 1 job/s each second: 40/s one 20 s cold start ahead; x1.2 headroom at
    # 10/s a replica = 4.8 replicas (5 ready serve 50/s: no backlog builds meanwhile).
    decided = need(signals(online=LaneLoad(arrival_rate=20.0, trend=1.0), live=5), POLICY)
    assert decided.online == pytest.approx(4.8)
    assert decided.replicas == 5
    assert "online 40.0/s forecast 20.0s ahead" in decided.reason and "4.80 replicas" in decided.reason
    # Without the trend the same rate needs 2.4: the forecast is what scales ahead of the spike.
    assert need(signals(online=LaneLoad(arrival_rate=20.0), live=5), POLICY).replicas == 3


def test_the_backlog_that_builds_during_a_cold_start_is_drained_too() -> None:
    # One replica ready (10/s) under a forecast of 40/s: by the time new ones serve, 20 s later,
    # 600 more wait; draining them in 30 s takes 2 replicas on top of the 4.8.
    decided = need(signals(online=LaneLoad(arrival_rate=20.0, trend=1.0), live=3, ready=1), POLICY)
    assert decided.online == pytest.approx(6.8) and decided.replicas == 7
    assert "backlog 0 (600 by then)" in decided.reason and "1 ready" in decided.reason


def test_a_backlog_adds_what_drains_it_within_the_target() -> None:
    # 600 waiting at 10/s a replica: 2 replicas drain it in 30 s.
    decided = need(signals(online=LaneLoad(backlog=600), bulk=LaneLoad(backlog=300)), POLICY)
    assert (decided.online, decided.bulk, decided.replicas) == (pytest.approx(2.0), pytest.approx(1.0), 3)


def test_the_bounds_clamp_and_say_so() -> None:
    decided = need(signals(online=LaneLoad(backlog=100_000), max_replicas=3), POLICY)
    assert decided.replicas == 3 and "clamped to [1, 3]" in decided.reason


def test_an_unmeasured_pool_holds_and_adds_one_when_work_waits() -> None:
    assert need(signals(service_rate=None, live=2), POLICY).replicas == 2
    grown = need(signals(service_rate=None, live=2, online=LaneLoad(backlog=5)), POLICY)
    assert grown.replicas == 3 and "not measured" in grown.reason


def test_scale_up_is_immediate_and_scale_down_waits_for_the_window_then_steps() -> None:
    stabilizer = Stabilizer(policy=POLICY)
    assert stabilizer.apply(0.0, 6, 1) == (6, "")
    # Lower recommendations within 300 s of the 6 hold it.
    for t in (10.0, 100.0, 299.0):
        desired, why = stabilizer.apply(t, 2, 6)
        assert desired == 6 and "holding 6" in why
    # Once the 6 has left the window: one step down per decision.
    assert stabilizer.apply(301.0, 2, 6)[0] == 5
    assert stabilizer.apply(303.0, 2, 5)[0] == 4


def test_a_periodic_load_does_not_flap() -> None:
    stabilizer = Stabilizer(policy=POLICY)
    desired, changes = 1, 0
    for tick in range(0, 3600, 2):
        recommended = 6 if tick % 180 < 30 else 1  # a burst every 3 minutes
        new, _ = stabilizer.apply(float(tick), recommended, desired)
        changes += new != desired
        desired = new
    assert changes == 1 and desired == 6


def test_the_rate_tracker_follows_a_step_and_reports_its_trend() -> None:
    tracker = RateTracker(smoothing_s=10.0)
    arrived = 0
    tracker.observe(0.0, arrived)
    for t in range(1, 61):
        arrived += 10
        rate = tracker.observe(float(t), arrived)
    assert rate.rate == pytest.approx(10.0, rel=0.02) and abs(rate.trend) < 0.1
    for t in range(61, 66):
        arrived += 50
        rate = tracker.observe(float(t), arrived)
    assert rate.rate > 20 and rate.trend > 1
    # A recreated stream (its counter restarted) does not read as a negative rate.
    assert tracker.observe(70.0, 0).rate == rate.rate
