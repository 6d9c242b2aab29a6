"""The local actuator on stand-in worker processes (`sleep`): one process per placement group,
a group that leaves the plan drained, a dead process restarted after its backoff, and a plan's
change of versions within a group starting no process at all (the process follows its group)."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from scheduler.supervisor import Supervisor
from sluice.wire.placements import Group, PlacedVersion, PlacementPlan


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def plan(**groups: list[str]) -> PlacementPlan:
    return PlacementPlan(at=0.0, groups={name: Group(tier="latency", threads=1, versions=tuple(
        PlacedVersion(model=m, version="v1", config="c") for m in models)) for name, models in groups.items()})


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def make(tmp_path: Path, clock: Clock) -> Iterator[Callable[[], Supervisor]]:
    made: list[Supervisor] = []
    started: list[list[str]] = []

    def build() -> Supervisor:
        def command(group: str, threads: int) -> list[str]:
            started.append([group, str(threads)])
            return ["sleep", "60"]

        supervisor = Supervisor(command=command, log_dir=tmp_path, stop_grace_s=5, clock=clock)
        made.append(supervisor)
        return supervisor

    yield build
    for supervisor in made:
        supervisor.stop_all()


def test_each_group_gets_one_process_and_a_change_within_a_group_starts_none(
    make: Callable[[], Supervisor],
) -> None:
    supervisor = make()
    supervisor.apply(plan(g1=["a", "b"], g2=["c"]))
    first = supervisor.pids()
    assert set(first) == {"g1", "g2"}
    supervisor.apply(plan(g1=["a", "b", "d"], g2=["c"]))
    assert supervisor.pids() == first


def test_a_group_that_leaves_the_plan_is_drained_with_sigterm(make: Callable[[], Supervisor]) -> None:
    supervisor = make()
    supervisor.apply(plan(g1=["a"], g2=["b"]))
    gone = supervisor.groups["g2"].current
    assert gone is not None
    supervisor.apply(plan(g1=["a"]))
    assert set(supervisor.pids()) == {"g1"}
    assert gone.process.wait(timeout=5) == -signal.SIGTERM


def test_a_dead_process_is_restarted_after_its_backoff(make: Callable[[], Supervisor], clock: Clock) -> None:
    supervisor = make()
    supervisor.apply(plan(g1=["a"]))
    dead = supervisor.pids()["g1"]
    process = supervisor.groups["g1"].current
    assert process is not None
    process.process.kill()
    process.process.wait()
    supervisor.reconcile()
    assert supervisor.pids() == {}  # the first restart waits a second
    clock.now += 1.5
    supervisor.reconcile()
    assert supervisor.pids()["g1"] != dead


def test_stop_all_drains_every_process(make: Callable[[], Supervisor]) -> None:
    supervisor = make()
    supervisor.apply(plan(g1=["a"], g2=["b"]))
    processes = [slot.current.process for slot in supervisor.groups.values() if slot.current]
    supervisor.stop_all()
    assert all(isinstance(p, subprocess.Popen) and p.poll() is not None for p in processes)
    assert supervisor.pids() == {}
