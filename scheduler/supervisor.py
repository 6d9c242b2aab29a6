"""The local actuator: one object that starts, checks, reaps, respawns and stops worker processes.

It is told how many replicas each (model, version) should have and makes it so. A worker that
dies is restarted with capped exponential backoff; one that refused its artifact (it exits with
`EXIT_ARTIFACT_REFUSED`) waits much longer, since restarting it cannot help until an operator
fixes the version. Scaling down drains the youngest worker (its first SIGTERM: it stops reading,
finishes and acknowledges what it holds) without waiting for it: a draining worker is reaped by
a later `reconcile`, or killed once it has overrun the grace period.

A version whose configuration changes (its `config`: batching, tenant isolation, artifact) is
rolled: one new worker is started beside the pool, and once its heartbeat says `ready` (the caller
passes the ready pids) the oldest stale worker is drained; then the next, until none is stale.
The pool never has fewer ready workers than it had, and no job is lost (a drained worker finishes
what it holds). When every slot is taken there is no room for a worker beside the pool: then the
oldest stale one drains first and its replacement starts in its place, one at a time, each only
once the pool's other workers are ready.

Every worker gets `cores // slots` torch threads, so with at most `slots` workers (the
autoscaler's budget) the threads never oversubscribe the cores, whatever the pools' sizes.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sluice.errors import EXIT_ARTIFACT_REFUSED
from sluice.processes import die_with_parent

log = logging.getLogger(__name__)

VersionKey = tuple[str, str]
CommandFactory = Callable[[str, str, int], list[str]]


# A replacement that has not reported ready by then is given up (and tried again): a worker that
# cannot start is reaped and restarted by the usual backoff.
REPLACE_WITHIN_S = 300.0


@dataclass
class _Replica:
    process: subprocess.Popen[bytes]
    started_at: float
    log_path: Path
    config: str = ""


@dataclass
class _Pool:
    replicas: list[_Replica] = field(default_factory=list)
    draining: list[tuple[_Replica, float]] = field(default_factory=list)  # (replica, kill after)
    desired: int = 0
    config: str = ""  # what every replica should run; a replica started on another is stale
    surge: _Replica | None = None  # the replacement started for a stale replica, not ready yet
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

    def set_desired(self, desired: Mapping[VersionKey, int], *, configs: Mapping[VersionKey, str] | None = None,
                    ready_pids: Collection[int] = ()) -> None:
        for key, count in desired.items():
            pool = self.pools.setdefault(key, _Pool())
            pool.desired = count
            if configs is not None:
                pool.config = configs.get(key, "")
        for key, pool in self.pools.items():
            if key not in desired:
                pool.desired = 0
        self.reconcile(ready_pids=ready_pids)

    def reconcile(self, *, ready_pids: Collection[int] = ()) -> None:
        now = self.clock()
        for key, pool in self.pools.items():
            self._reap(key, pool, now)
            self._reap_draining(pool, now)
            self._roll(key, pool, now, ready_pids)
            # The surge replica is extra while it replaces a stale one.
            allowed = pool.desired + (1 if pool.surge is not None else 0)
            while len(pool.replicas) > allowed:
                # Stale ones first, then the youngest.
                stale = [r for r in pool.replicas if r.config != pool.config and r is not pool.surge]
                self._drain(key, pool, stale[0] if stale else pool.replicas[-1], now)
            if len(pool.replicas) < pool.desired and now >= pool.next_start_at:
                for _ in range(pool.desired - len(pool.replicas)):
                    pool.replicas.append(self._start(key))

    def _roll(self, key: VersionKey, pool: _Pool, now: float, ready_pids: Collection[int]) -> None:
        """One step of replacing the replicas that run an old configuration."""
        surge = pool.surge
        if surge is not None:
            if surge not in pool.replicas or now - surge.started_at > REPLACE_WITHIN_S:
                pool.surge = None  # it died (reaped) or never got ready: start over
            elif surge.process.pid in ready_pids:
                pool.surge = None
                stale = [r for r in pool.replicas if r.config != pool.config]
                if stale:
                    log.info("worker %s/%s pid %d replaced by pid %d (new configuration)", key[0], key[1],
                             stale[0].process.pid, surge.process.pid)
                    self._drain(key, pool, stale[0], now)
            return
        stale = [r for r in pool.replicas if r.config != pool.config]
        if not stale or pool.desired == 0 or now < pool.next_start_at:
            return
        if sum(len(p.replicas) for p in self.pools.values()) < self.slots:
            pool.surge = self._start(key)
            pool.replicas.append(pool.surge)
        elif all(r.process.pid in ready_pids for r in pool.replicas):
            log.info("worker %s/%s pid %d replaced in place (no free slot beside the pool)", key[0], key[1],
                     stale[0].process.pid)
            self._drain(key, pool, stale[0], now)

    def _drain(self, key: VersionKey, pool: _Pool, replica: _Replica, now: float) -> None:
        pool.replicas.remove(replica)
        if replica.process.poll() is None:
            replica.process.send_signal(signal.SIGTERM)
        log.info("draining worker %s/%s pid %d", key[0], key[1], replica.process.pid)
        pool.draining.append((replica, now + self.stop_grace_s))

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
        return _Replica(process=process, started_at=self.clock(), log_path=log_path, config=self.pools[key].config)

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
