"""The local actuator's rolling replacement, on stand-in worker processes (`sleep`): a new worker
beside the pool while a slot is free, replacement in place when none is, one at a time, a stale
worker drained only once its replacement (or the rest of its pool) is ready."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from scheduler.supervisor import Supervisor

KEY = ("m", "v1")


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Callable[..., Supervisor]]:
    made: list[Supervisor] = []

    def build(*, slots: int) -> Supervisor:
        supervisor = Supervisor(command=lambda model, version, threads: ["sleep", "60"], log_dir=tmp_path,
                                cores=slots, slots=slots, stop_grace_s=5)
        made.append(supervisor)
        return supervisor

    yield build
    for supervisor in made:
        supervisor.stop_all()


def pids(supervisor: Supervisor) -> list[int]:
    return [r.process.pid for r in supervisor.pools[KEY].replicas]


def configs(supervisor: Supervisor) -> list[str]:
    return [r.config for r in supervisor.pools[KEY].replicas]


def test_with_a_free_slot_a_new_worker_starts_beside_the_pool_before_an_old_one_drains(
    make: Callable[..., Supervisor],
) -> None:
    supervisor = make(slots=3)
    supervisor.set_desired({KEY: 2}, configs={KEY: "a"})
    old = pids(supervisor)
    supervisor.set_desired({KEY: 2}, configs={KEY: "b"}, ready_pids=old)
    assert configs(supervisor) == ["a", "a", "b"]  # the surge, beside both old ones
    surge = pids(supervisor)[-1]
    supervisor.set_desired({KEY: 2}, configs={KEY: "b"}, ready_pids=old)  # not ready yet: nothing drains
    assert len(pids(supervisor)) == 3
    supervisor.set_desired({KEY: 2}, configs={KEY: "b"}, ready_pids=[*old, surge])
    assert pids(supervisor) == [old[1], surge]
    assert [draining.process.pid for draining, _ in supervisor.pools[KEY].draining] == [old[0]]
    supervisor.set_desired({KEY: 2}, configs={KEY: "b"}, ready_pids=[*old, surge])  # the next one
    newer = pids(supervisor)[-1]
    supervisor.set_desired({KEY: 2}, configs={KEY: "b"}, ready_pids=[surge, newer])
    assert configs(supervisor) == ["b", "b"] and pids(supervisor) == [surge, newer]


def test_with_every_slot_taken_an_old_worker_is_replaced_in_place_one_at_a_time(
    make: Callable[..., Supervisor],
) -> None:
    supervisor = make(slots=2)
    supervisor.set_desired({KEY: 2}, configs={KEY: "a"})
    old = pids(supervisor)
    supervisor.set_desired({KEY: 2}, configs={KEY: "b"}, ready_pids=old)
    # Never more workers than slots: the first old one drained, its replacement started.
    assert configs(supervisor) == ["a", "b"] and pids(supervisor)[0] == old[1]
    replacement = pids(supervisor)[1]
    supervisor.set_desired({KEY: 2}, configs={KEY: "b"}, ready_pids=[old[1]])  # replacement not ready
    assert pids(supervisor) == [old[1], replacement]
    supervisor.set_desired({KEY: 2}, configs={KEY: "b"}, ready_pids=[old[1], replacement])
    assert configs(supervisor) == ["b", "b"] and old[1] not in pids(supervisor)
