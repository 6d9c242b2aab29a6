"""The local actuator: one worker process per placement group, started, checked, reaped,
respawned and stopped.

It is handed the scheduler's placement plan and keeps exactly one live `sluice worker --group G`
process per group in it. What each process serves is the plan's business: the process reads its
group's entry itself (workers/host.py), so adding a version to a group, or changing a version's
configuration, needs no process start here. A process that dies is restarted with capped
exponential backoff; a group that leaves the plan has its process drained (its first SIGTERM: it
stops reading, finishes and acknowledges what it holds) without waiting for it: a draining process
is reaped by a later `reconcile`, or killed once it has overrun the grace period.

Every process gets the threads the plan gives its group (`cores // processes budget`), so the
threads never oversubscribe the cores while the plan stays within its process budget; only floors
that cannot share a process open more (docs/ARCHITECTURE.md, "Placement").
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from sluice.processes import die_with_parent
from sluice.wire.placements import PlacementPlan

log = logging.getLogger(__name__)

CommandFactory = Callable[[str, int], list[str]]


@dataclass
class _Process:
    process: subprocess.Popen[bytes]
    started_at: float
    log_path: Path


@dataclass
class _Slot:
    """One group's process and its restart state."""

    threads: int
    current: _Process | None = None
    failures: int = 0
    next_start_at: float = 0.0


class Supervisor:
    def __init__(
        self,
        *,
        command: CommandFactory,
        log_dir: Path,
        env: Mapping[str, str] | None = None,
        stop_grace_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.command = command
        self.log_dir = log_dir
        self.env = dict(env if env is not None else os.environ)
        self.stop_grace_s = stop_grace_s
        self.clock = clock
        self.groups: dict[str, _Slot] = {}
        self._draining: list[tuple[_Process, float]] = []  # processes of groups no longer planned
        log_dir.mkdir(parents=True, exist_ok=True)

    def pids(self) -> dict[str, int]:
        """The live process of each group."""
        return {name: slot.current.process.pid for name, slot in self.groups.items()
                if slot.current is not None and slot.current.process.poll() is None}

    def apply(self, plan: PlacementPlan) -> None:
        for name, group in plan.groups.items():
            slot = self.groups.setdefault(name, _Slot(threads=group.threads))
            slot.threads = group.threads
        for name in set(self.groups).difference(plan.groups):
            slot = self.groups.pop(name)
            if slot.current is not None:
                self._drain(name, slot.current)
        self.reconcile()

    def reconcile(self) -> None:
        now = self.clock()
        for name, slot in self.groups.items():
            self._reap(name, slot, now)
            if slot.current is None and now >= slot.next_start_at:
                slot.current = self._start(name, slot.threads)
        for entry in list(self._draining):
            process, kill_after = entry
            if process.process.poll() is None:
                if now < kill_after:
                    continue
                process.process.kill()
                process.process.wait()
            self._draining.remove(entry)

    def _reap(self, name: str, slot: _Slot, now: float) -> None:
        current = slot.current
        if current is None:
            return
        code = current.process.poll()
        if code is None:
            if now - current.started_at > 60:
                slot.failures = 0  # a process that stayed up a minute resets the backoff
            return
        slot.current = None
        slot.failures += 1
        delay = min(30.0, 2.0 ** (slot.failures - 1))
        slot.next_start_at = now + delay
        log.warning("worker process of group %s (pid %d) exited with %s; restarting in %.0fs (log: %s)",
                    name, current.process.pid, code, delay, current.log_path)

    def _drain(self, name: str, process: _Process) -> None:
        if process.process.poll() is None:
            process.process.send_signal(signal.SIGTERM)
        log.info("draining the worker process of group %s (pid %d): the group left the plan", name,
                 process.process.pid)
        self._draining.append((process, self.clock() + self.stop_grace_s))

    def _start(self, name: str, threads: int) -> _Process:
        argv = self.command(name, threads)
        log_path = self.log_dir / f"worker-{name}.log"
        env = dict(self.env, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        with log_path.open("ab") as sink:
            # A scheduler that dies (even by SIGKILL) takes its workers with it; they drain first.
            process = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True, preexec_fn=die_with_parent(signal.SIGTERM))
        log.info("started the worker process of group %s: pid %d (%d threads)", name, process.pid, threads)
        return _Process(process=process, started_at=self.clock(), log_path=log_path)

    def stop_all(self) -> None:
        """Drain every process at once (SIGTERM to all, then wait), killing stragglers at the grace."""
        processes = [p for p, _ in self._draining] + [s.current for s in self.groups.values() if s.current]
        for process in processes:
            if process.process.poll() is None:
                process.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace_s
        for process in processes:
            try:
                process.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.process.kill()
                process.process.wait()
        self.groups.clear()
        self._draining.clear()
