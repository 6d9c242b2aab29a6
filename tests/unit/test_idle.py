"""Scale to zero (scheduler/idle.py) in simulated time, alone and inside `Autoscaler.decide`."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduler.autoscale import ScalingPolicy
from scheduler.idle import Activity, IdlePolicy, IdleWatch, ZeroState
from scheduler.placement import Budget
from scheduler.planning.capacity_sim import CostModel, SimConfig, Trace, simulate
from scheduler.scaling import Autoscaler, LaneReading, PoolReading, ScaledVersion
from sluice.routing import VersionInfo
from sluice.versions import VersionState
from sluice.wire.heartbeats import Heartbeat, WorkerState

IDLE_S = 300.0
NONE: frozenset[str] = frozenset()
W1 = frozenset({"w1"})


def watch() -> IdleWatch:
    return IdleWatch(policy=IdlePolicy(idle_s=IDLE_S))


def test_a_version_with_nothing_queued_and_no_worker_starts_asleep() -> None:
    decision = watch().observe(0.0, Activity(backlog=0, arrived=0, ready=NONE))
    assert decision.state is ZeroState.asleep and decision.floor == 0


def test_a_served_version_is_released_only_after_a_whole_idle_period() -> None:
    idle = watch()
    assert idle.observe(0.0, Activity(backlog=0, arrived=5, ready=W1)).state is ZeroState.awake
    assert idle.observe(IDLE_S - 1, Activity(backlog=0, arrived=5, ready=W1)).state is ZeroState.awake
    released = idle.observe(IDLE_S, Activity(backlog=0, arrived=5, ready=W1))
    assert released.state is ZeroState.asleep and released.floor == 0
    assert "idle 300 s" in released.reason


@pytest.mark.parametrize("activity", [Activity(backlog=0, arrived=6, ready=W1),  # an arrival, already run
                                      Activity(backlog=2, arrived=5, ready=W1)])  # a job still running
def test_an_arrival_or_a_job_in_the_streams_restarts_the_idle_period(activity: Activity) -> None:
    idle = watch()
    idle.observe(0.0, Activity(backlog=0, arrived=5, ready=W1))
    assert idle.observe(200.0, activity).state is ZeroState.awake
    quiet = Activity(backlog=0, arrived=activity.arrived, ready=W1)
    assert idle.observe(200.0 + IDLE_S - 1, quiet).state is ZeroState.awake
    assert idle.observe(200.0 + IDLE_S, quiet).state is ZeroState.asleep


def test_one_job_wakes_an_asleep_version_which_is_awake_once_a_worker_is_ready() -> None:
    idle = watch()
    idle.observe(0.0, Activity(backlog=0, arrived=3, ready=NONE))
    assert idle.observe(10.0, Activity(backlog=0, arrived=3, ready=NONE)).state is ZeroState.asleep
    woken = idle.observe(12.0, Activity(backlog=1, arrived=4, ready=NONE))
    assert woken.state is ZeroState.waking and woken.floor == 1 and "woken by 1 queued" in woken.reason
    # Still starting: it stays waking, with its floor of one.
    assert idle.observe(14.0, Activity(backlog=1, arrived=4, ready=NONE)).state is ZeroState.waking
    assert idle.observe(16.0, Activity(backlog=0, arrived=4, ready=W1)).state is ZeroState.awake
    # Its idle period counts from the last activity (the job in the streams at 14 s).
    assert idle.observe(14.0 + IDLE_S, Activity(backlog=0, arrived=4, ready=W1)).state is ZeroState.asleep


def test_an_arrival_seen_only_as_the_counter_moving_wakes_it_too() -> None:
    """A job cancelled (or expired) between two looks leaves an empty stream; its arrival still counts."""
    idle = watch()
    idle.observe(0.0, Activity(backlog=0, arrived=3, ready=NONE))
    assert idle.observe(2.0, Activity(backlog=0, arrived=4, ready=NONE)).state is ZeroState.waking


def test_a_recreated_stream_counts_as_activity() -> None:
    idle = watch()
    idle.observe(0.0, Activity(backlog=0, arrived=9, ready=W1))
    assert idle.observe(IDLE_S - 1, Activity(backlog=0, arrived=1, ready=W1)).state is ZeroState.awake
    assert idle.observe(IDLE_S + 1, Activity(backlog=0, arrived=1, ready=W1)).state is ZeroState.awake


def test_a_released_worker_still_draining_is_not_the_one_a_wake_started() -> None:
    idle = watch()
    idle.observe(0.0, Activity(backlog=0, arrived=5, ready=W1))
    assert idle.observe(IDLE_S, Activity(backlog=0, arrived=5, ready=W1)).state is ZeroState.asleep
    # A job right after the release, while w1 drains and still reports ready.
    assert idle.observe(IDLE_S + 1, Activity(backlog=1, arrived=6, ready=W1)).state is ZeroState.waking
    assert idle.observe(IDLE_S + 2, Activity(backlog=1, arrived=6, ready=W1)).state is ZeroState.waking
    assert idle.observe(IDLE_S + 3, Activity(backlog=1, arrived=6, ready=NONE)).state is ZeroState.waking
    woken = frozenset({"w2"})
    assert idle.observe(IDLE_S + 4, Activity(backlog=0, arrived=6, ready=woken)).state is ZeroState.awake


def test_the_idle_period_must_be_positive() -> None:
    with pytest.raises(ValueError, match="invalid idle policy"):
        IdlePolicy(idle_s=0)


# --- inside the autoscaler ----------------------------------------------------------------------

KEY = ("m", "v1")


def scaled(min_replicas: int) -> dict[tuple[str, str], ScaledVersion]:
    info = VersionInfo(model="m", version="v1", state=VersionState.stable, artifact="synthetic:", sha256="0" * 64,
                       min_replicas=min_replicas, max_replicas=4)
    return {KEY: ScaledVersion(info=info, tier="latency", kind="synthetic")}


def reading(*, queued: int, added: int, ready: bool) -> dict[tuple[str, str], PoolReading]:
    beats = (Heartbeat(state=WorkerState.ready, items_per_s=50.0, batch_size=4, cold_start_s=1.0, processed=10,
                       pid=7, at=0.0, group="g1"),) if ready else ()
    return {KEY: PoolReading(online=LaneReading(queued=queued, added=added), bulk=LaneReading(0, 0), beats=beats,
                             workers=("w1",) if ready else ())}


def autoscaler(processes: int = 1) -> Autoscaler:
    return Autoscaler(policy=ScalingPolicy(), budget=Budget(processes=processes, threads_per_process=1,
                                                             memory_per_process=2**34, pack_across_tiers=True),
                      idle=IdlePolicy(idle_s=IDLE_S))


def test_the_autoscaler_releases_an_idle_min_zero_version_and_a_job_wakes_it() -> None:
    scaler = autoscaler()
    decisions, placed = scaler.decide(scaled(0), reading(queued=0, added=10, ready=True), now=0.0)
    assert decisions[KEY].zero is ZeroState.awake and placed.replicas(KEY) == 1
    decisions, placed = scaler.decide(scaled(0), reading(queued=0, added=10, ready=True), now=IDLE_S)
    assert decisions[KEY].zero is ZeroState.asleep and decisions[KEY].desired == 0
    assert placed.replicas(KEY) == 0 and not placed.groups and KEY not in placed.not_served
    decisions, placed = scaler.decide(scaled(0), reading(queued=1, added=11, ready=False), now=IDLE_S + 2)
    assert decisions[KEY].zero is ZeroState.waking and decisions[KEY].desired >= 1
    assert placed.replicas(KEY) == 1


def test_a_wake_is_placed_as_a_floor_even_with_no_process_left_in_the_budget() -> None:
    scaler = autoscaler(processes=1)
    other = ("n", "v1")
    versions = {**scaled(0), other: ScaledVersion(info=VersionInfo(
        model="n", version="v1", state=VersionState.stable, artifact="synthetic:?x", sha256="1" * 64, min_replicas=1,
        max_replicas=1), tier="batch", kind="synthetic")}
    readings = {**reading(queued=0, added=0, ready=False),
                other: PoolReading(online=LaneReading(0, 0), bulk=LaneReading(0, 0), beats=())}
    scaler.budget = Budget(processes=1, threads_per_process=1, memory_per_process=2**34, pack_across_tiers=False)
    _, placed = scaler.decide(versions, readings, now=0.0)
    assert placed.replicas(KEY) == 0 and placed.replicas(other) == 1
    readings = {**readings, **reading(queued=1, added=1, ready=False)}
    _, placed = scaler.decide(versions, readings, now=2.0)
    assert placed.replicas(KEY) == 1 and any("over the 1-process budget" in c for c in placed.changes)


def test_while_its_first_worker_starts_a_waking_version_holds_one_process_whatever_waits() -> None:
    scaler = autoscaler(processes=4)
    scaler.decide(scaled(0), reading(queued=0, added=0, ready=False), now=0.0)
    starting = Heartbeat(state=WorkerState.starting, items_per_s=0.0, batch_size=0, cold_start_s=0.0, processed=0,
                         pid=8, at=0.0, group="g1")
    for now in (2.0, 4.0, 6.0, 8.0):
        readings = {KEY: replace(reading(queued=5000, added=5000, ready=False)[KEY], beats=(starting,),
                                 workers=("w9",))}
        decisions, placed = scaler.decide(scaled(0), readings, now=now)
        assert decisions[KEY].zero is ZeroState.waking and decisions[KEY].desired == 1
        assert placed.replicas(KEY) == 1
    # Ready: the lag policy sizes it, from one upwards.
    decisions, placed = scaler.decide(scaled(0), reading(queued=5000, added=5000, ready=True), now=10.0)
    assert decisions[KEY].zero is ZeroState.awake and placed.replicas(KEY) > 1


def test_a_version_with_a_floor_never_goes_to_zero() -> None:
    scaler = autoscaler()
    for now in (0.0, IDLE_S, 10 * IDLE_S):
        decisions, placed = scaler.decide(scaled(1), reading(queued=0, added=10, ready=True), now=now)
        assert decisions[KEY].zero is None and placed.replicas(KEY) == 1


# --- in the capacity simulator ---------------------------------------------------------------------


def test_in_simulated_time_a_min_zero_pool_sleeps_between_bursts_and_pays_a_cold_start_to_wake() -> None:
    bursts = Trace("bursts", lambda t: 5.0 if t < 60 or 1200 <= t < 1260 else 0.0, 1800.0)
    cost = CostModel(cold_start_s=20.0)
    floor = simulate(bursts, "lag", cost=cost, config=SimConfig(min_replicas=1, seed=3))
    zero = simulate(bursts, "lag", cost=cost, config=SimConfig(min_replicas=0, idle_s=IDLE_S, seed=3))
    assert zero.jobs == floor.jobs > 0  # every job ran
    # Asleep from about 60 + 300 s to the second burst, and again after it: far fewer replica-minutes.
    assert zero.replica_minutes < 0.7 * floor.replica_minutes
    # The jobs that woke it waited for a worker to start.
    assert zero.p99_ms >= 1000 * cost.cold_start_s * 0.5 > floor.p99_ms
