"""The local actuator: one object that starts, checks, reaps, respawns and stops worker processes.

It is told how many replicas each (model, version) should have and makes it so. A worker that
dies is restarted with capped exponential backoff; one that refused its artifact (it exits with
`EXIT_ARTIFACT_REFUSED`) waits much longer, since restarting it cannot help until an operator
fixes the version. Scaling down drains the youngest worker (its first SIGTERM: it stops reading,
finishes and acknowledges what it holds) without waiting for it: a draining worker is reaped by
a later `reconcile`, or killed once it has overrun the grace period.

Every worker gets `cores // slots` torch threads, so with at most `slots` workers (the
autoscaler's budget) the threads never oversubscribe the cores, whatever the pools' sizes.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sluice.errors import EXIT_ARTIFACT_REFUSED
from sluice.processes import die_with_parent

log = logging.getLogger(__name__)

VersionKey = tuple[str, str]
CommandFactory = Callable[[str, str, int], list[str]]


@dataclass
class _Replica:
    process: subprocess.Popen[bytes]
    started_at: float
    log_path: Path


@dataclass
class _Pool:
    replicas: list[_Replica] = field(default_factory=list)
    draining: list[tuple[_Replica, float]] = field(default_factory=list)  # (replica, kill after)
    desired: int = 0
    failures: int = 0
    next_start_at: float = 0.0


class Supervisor:
    def __init__(
        self,
        *,
        command: CommandFactory,
        log_dir: Path,
        cores: int,
        slots: int | None = None,
        env: Mapping[str, str] | None = None,
        stop_grace_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.command = command
        self.log_dir = log_dir
        self.cores = max(1, cores)
        self.slots = max(1, slots or self.cores)
        self.env = dict(env if env is not None else os.environ)
        self.stop_grace_s = stop_grace_s
        self.clock = clock
        self.pools: dict[VersionKey, _Pool] = {}
        log_dir.mkdir(parents=True, exist_ok=True)

    def threads_per_worker(self) -> int:
        """One slot's share of the cores: never oversubscribed by at most `slots` workers."""
        return max(1, self.cores // self.slots)

    def live(self, key: VersionKey) -> int:
        pool = self.pools.get(key)
        return sum(1 for r in pool.replicas if r.process.poll() is None) if pool else 0

    def set_desired(self, desired: Mapping[VersionKey, int]) -> None:
        for key, count in desired.items():
            self.pools.setdefault(key, _Pool()).desired = count
        for key, pool in self.pools.items():
            if key not in desired:
                pool.desired = 0
        self.reconcile()

    def reconcile(self) -> None:
        now = self.clock()
        for key, pool in self.pools.items():
            self._reap(key, pool, now)
            self._reap_draining(pool, now)
            while len(pool.replicas) > pool.desired:
                replica = pool.replicas.pop()  # the youngest
                if replica.process.poll() is None:
                    replica.process.send_signal(signal.SIGTERM)
                log.info("draining worker %s/%s pid %d", key[0], key[1], replica.process.pid)
                pool.draining.append((replica, now + self.stop_grace_s))
            if len(pool.replicas) < pool.desired and now >= pool.next_start_at:
                for _ in range(pool.desired - len(pool.replicas)):
                    pool.replicas.append(self._start(key))

    def _reap(self, key: VersionKey, pool: _Pool, now: float) -> None:
        for replica in list(pool.replicas):
            code = replica.process.poll()
            if code is None:
                if now - replica.started_at > 60:
                    pool.failures = 0  # a replica that stayed up a minute resets the backoff
                continue
            pool.replicas.remove(replica)
            pool.failures += 1
            base = 60.0 if code == EXIT_ARTIFACT_REFUSED else 1.0
            delay = min(300.0 if code == EXIT_ARTIFACT_REFUSED else 30.0, base * 2 ** (pool.failures - 1))
            pool.next_start_at = now + delay
            log.warning("worker %s/%s pid %d exited with %s; restarting in %.0fs (log: %s)",
                        key[0], key[1], replica.process.pid, code, delay, replica.log_path)

    @staticmethod
    def _reap_draining(pool: _Pool, now: float) -> None:
        for replica, kill_after in list(pool.draining):
            if replica.process.poll() is None:
                if now < kill_after:
                    continue
                replica.process.kill()
                replica.process.wait()
            pool.draining.remove((replica, kill_after))

    def _start(self, key: VersionKey) -> _Replica:
        model, version = key
        threads = self.threads_per_worker()
        argv = self.command(model, version, threads)
        index = len(self.pools[key].replicas)
        log_path = self.log_dir / f"worker-{model}-{version}-{index}.log"
        env = dict(self.env, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        with log_path.open("ab") as sink:
            # A scheduler that dies (even by SIGKILL) takes its workers with it; they drain first.
            process = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True, preexec_fn=die_with_parent(signal.SIGTERM))
        log.info("started worker %s/%s pid %d (%d threads)", model, version, process.pid, threads)
        return _Replica(process=process, started_at=self.clock(), log_path=log_path)

    def stop_all(self) -> None:
        """Drain every worker at once (SIGTERM to all, then wait), killing stragglers at the grace."""
        replicas = [r for pool in self.pools.values() for r in [*pool.replicas, *(d for d, _ in pool.draining)]]
        for replica in replicas:
            if replica.process.poll() is None:
                replica.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace_s
        for replica in replicas:
            try:
                replica.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                replica.process.kill()
                replica.process.wait()
        for pool in self.pools.values():
            pool.replicas.clear()
            pool.draining.clear()
            pool.desired = 0
