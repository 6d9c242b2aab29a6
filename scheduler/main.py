"""`sluice scheduler`: places every servable version on worker processes, sized to its load.

Every `scale_interval_s` (and on each routing event) it reads the registry and what Redis shows
of each version, asks the autoscaler (scheduler/scaling.py, deciding with scheduler/autoscale.py
and scheduler/placement.py) for the processes each version needs and which processes serve which
versions, publishes that placement plan (sluice/wire/placements.py), and hands it to an actuator.
With the `local` actuator it supervises one worker process per placement group on this machine;
with `kubernetes` it keeps a Deployment per group (scheduler/kubernetes.py); with `none` it only
publishes the plan and the decisions (metrics, and `GET /v1/models/{m}`) for compose. The
rollout controller (scheduler/rollout.py), the quality aggregator (scheduler/quality.py) and the
served mix's aggregator (scheduler/mix.py) run beside it, each on a thread of its own, as does the
deadline sweeper, which expires queued jobs past their deadline every `deadline_sweep_s`, between
the ticks.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Protocol

import redis

from scheduler.autoscale import ScalingPolicy
from scheduler.idle import IdlePolicy
from scheduler.mix import run_mix_aggregator
from scheduler.placement import Budget
from scheduler.quality import run_aggregator
from scheduler.retirement import retiring, watched
from scheduler.rollout import run_controller
from scheduler.scaling import (
    Autoscaler,
    PoolReading,
    ScaledVersion,
    VersionKey,
    draining_versions,
    publish,
    read_pools,
    retired_versions,
    scaled_versions,
    withdraw,
)
from scheduler.supervisor import Supervisor
from sluice import exposition
from sluice.errors import BrokerError, SluiceError
from sluice.registry import routing_table
from sluice.registry.store import Registry
from sluice.routing import RoutingSnapshot
from sluice.settings import Settings
from sluice.versions import VersionState
from sluice.wire import events, placements, settling
from sluice.wire.connections import connect_sync
from sluice.wire.placements import PlacementPlan

log = logging.getLogger(__name__)


def worker_command(python: str = sys.executable) -> Callable[[str, int], list[str]]:
    def build(group: str, threads: int) -> list[str]:
        return [python, "-m", "launch.cli", "worker", "--group", group, "--threads", str(threads)]

    return build


class Actuator(Protocol):
    """What carries out the placement plan: the local `Supervisor` (a process per group), or
    `scheduler/kubernetes.py`'s (a Deployment per group). `apply` takes each group on its own and
    never raises, so one group's failure neither stops the others nor the publishing of the plan."""

    def apply(self, plan: PlacementPlan) -> None: ...

    def reconcile(self) -> None: ...

    def stop_all(self) -> None: ...


class Scheduler:
    def __init__(self, *, registry: Registry, redis_url: str, supervisor: Actuator | None,
                 autoscaler: Autoscaler, refresh_s: float = 2.0, retire_drain_s: float = 60.0,
                 sweep_s: float = 0.5, scrape_target: exposition.ScrapeTarget | None = None) -> None:
        self.registry = registry
        self.redis_url = redis_url
        self.supervisor = supervisor
        self.autoscaler = autoscaler
        self.retire_drain_s = retire_drain_s
        self.refresh_s = refresh_s
        self.sweep_s = sweep_s
        # The versions whose deadlines are swept, as the last tick saw them (the sweeper's thread reads it).
        self._swept: list[VersionKey] = []
        self.stopping = threading.Event()
        self._wake = threading.Event()
        self._redis = connect_sync(redis_url)
        self._snapshot: RoutingSnapshot | None = None
        self.scrape_target = scrape_target
        self._advertised_at = 0.0
        self._published: set[VersionKey] = set()  # the versions whose series `publish` set
        self._resume()

    def _resume(self) -> None:
        """Start from the plan a previous scheduler published, so the groups keep their ids and
        their versions: a Deployment per group outlives the scheduler, and a restart must not
        reshuffle what every process serves."""
        try:
            plan = placements.read(self._redis)
        except BrokerError as exc:
            log.warning("could not read the last placement plan, starting afresh: %s", exc)
            return
        if plan is not None:
            self.autoscaler.resume(plan)

    def request_stop(self) -> None:
        self.stopping.set()
        self._wake.set()

    def tick(self) -> None:
        # Before the registry: a scheduler that cannot scale still has metrics worth scraping.
        with contextlib.suppress(BrokerError):
            self._advertise()
        try:
            with self.registry.session() as session:
                self._snapshot = routing_table.routing_snapshot(session)
        except SluiceError as exc:
            if self._snapshot is None:
                log.warning("registry unreachable, keeping the current pools: %s", exc)
                if self.supervisor:
                    self.supervisor.reconcile()
                return
            log.warning("registry unreachable, scaling on the last routing snapshot: %s", exc)
        versions = scaled_versions(self._snapshot)
        now = time.time()
        retired = {key: at for key, at in retired_versions(self._snapshot).items()
                   if watched(at, now=now, drain_s=self.retire_drain_s)}
        try:
            readings = read_pools(self._redis, [*versions, *retired], now=now)
            refused = placements.refused(self._redis)
            versions.update(self._settle(retired, readings, now=now))
        except BrokerError as exc:
            log.warning("Redis unreachable, keeping the current pools: %s", exc)
            if self.supervisor:
                self.supervisor.reconcile()
            return
        decisions, placed = self.autoscaler.decide(versions, readings, now=now)
        plan = placed.to_plan(at=now)
        not_served = {**plan.not_served, **{name: f"its artifact was refused: {why}" for name, why in refused.items()
                                            if tuple(name.split("/", 1)) in versions}}
        plan = replace(plan, not_served=not_served)
        try:
            publish(self._redis, decisions, readings, plan)
        except BrokerError as exc:
            log.warning("could not publish the scaling decisions: %s", exc)
            if self.supervisor:
                self.supervisor.reconcile()
            return
        if self.supervisor:
            self.supervisor.apply(plan)
        withdraw(self._published - decisions.keys())
        self._published = set(decisions)

    def _settle(self, retired: dict[VersionKey, float], readings: dict[VersionKey, PoolReading], *,
                now: float) -> dict[VersionKey, ScaledVersion]:
        """The jobs no worker will run: queued ones past their deadline expire, a retired version
        past its drain limit has the rest failed; answer the retired versions still draining,
        which stay placed (docs/ARCHITECTURE.md, "No job waits for a worker that will never come")."""
        assert self._snapshot is not None
        self._swept = [(model.name, name) for model in self._snapshot.models.values()
                       for name, version in model.versions.items()
                       if version.state != VersionState.retired or (model.name, name) in retired]
        _expire(self._redis, self._swept, now=now)
        backlog = {key: readings[key].online.queued + readings[key].bulk.queued for key in retired}
        decided = retiring(retired, backlog, now=now, drain_s=self.retire_drain_s)
        for key in sorted(decided.fail_now):
            failed = settling.fail_retired(self._redis, *key, now=now)
            log.warning("%s/%s: retired %.0f s ago, past its %.0f s drain limit: %d unfinished jobs failed "
                        "(version_retired)", *key, now - retired[key], self.retire_drain_s, failed)
        return draining_versions(self._snapshot, decided.keep_placed)

    def run_sweeper(self) -> None:
        """Until stopped: every `sweep_s`, expire the queued jobs past their deadline, on its own
        connection. The tick sweeps too, but a tick that reads the registry and starts processes
        may take seconds: a deadline (`start_by`) should not wait for it."""
        warned = False
        with connect_sync(self.redis_url) as client:
            while not self.stopping.wait(self.sweep_s):
                try:
                    _expire(client, self._swept, now=time.time())
                    warned = False
                except BrokerError as exc:
                    if not warned:
                        log.warning("the deadline sweeper cannot reach Redis, retrying: %s", exc)
                    warned = True

    def _advertise(self) -> None:
        now = time.time()
        if self.scrape_target is not None and now - self._advertised_at >= exposition.ADVERTISE_EVERY_S:
            exposition.advertise(self._redis, self.scrape_target, now=now)
            self._advertised_at = now

    def _listen(self) -> None:
        """Wake the loop on routing events so a new version gets workers at once."""
        while not self.stopping.is_set():
            try:
                with (connect_sync(self.redis_url, socket_timeout_s=None) as client,
                      client.pubsub(ignore_subscribe_messages=True) as pubsub):  # type: ignore[no-untyped-call]
                    pubsub.subscribe(events.channel(client))
                    while not self.stopping.is_set():
                        message = pubsub.get_message(timeout=1.0)
                        if message and isinstance(events.parse(message.get("data", b"")), events.RoutingChanged):
                            self._wake.set()
            except (redis.RedisError, redis.RedisClusterException, OSError):
                # RedisClusterException is no RedisError: a cluster client finding no node raises it.
                self.stopping.wait(2.0)

    def run(self) -> None:
        listener = threading.Thread(target=self._listen, name="scheduler-events", daemon=True)
        listener.start()
        controller = threading.Thread(target=run_controller, name="rollout-controller", daemon=True, kwargs={
            "registry": self.registry, "redis_url": self.redis_url, "stopping": self.stopping})
        controller.start()
        aggregator = threading.Thread(target=run_aggregator, name="quality-aggregator", daemon=True, kwargs={
            "registry": self.registry, "redis_url": self.redis_url, "stopping": self.stopping})
        aggregator.start()
        mixes = threading.Thread(target=run_mix_aggregator, name="mix-aggregator", daemon=True, kwargs={
            "registry": self.registry, "redis_url": self.redis_url, "stopping": self.stopping})
        mixes.start()
        sweeper = threading.Thread(target=self.run_sweeper, name="deadline-sweeper", daemon=True)
        sweeper.start()
        try:
            while not self.stopping.is_set():
                self.tick()
                self._wake.wait(self.refresh_s)
                self._wake.clear()
        finally:
            if self.supervisor:
                self.supervisor.stop_all()
            controller.join(timeout=10)
            aggregator.join(timeout=10)
            mixes.join(timeout=10)
            sweeper.join(timeout=10)
            if self.scrape_target is not None:
                with contextlib.suppress(BrokerError):
                    exposition.withdraw(self._redis, self.scrape_target)
            self._redis.close()


def _expire(client: redis.Redis, versions: list[VersionKey], *, now: float) -> None:
    for key, expired in settling.expire_due(client, versions, now=now).items():
        if expired:
            log.info("%s/%s: %d queued jobs expired past their deadline", *key, expired)


def local_supervisor(*, home: Path, env: dict[str, str] | None = None, stop_grace_s: float = 30.0) -> Supervisor:
    return Supervisor(command=worker_command(), log_dir=home / "logs", env=env, stop_grace_s=stop_grace_s)


def machine_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def budget(settings: Settings) -> Budget:
    """The processes the cores give (one per worker slot), each with its share of the cores' threads.

    Tiers share a process only where the operator says so, or where the budget gives one process
    in all: there, keeping them apart would leave one tier without any."""
    cores = settings.cpu_cores or os.cpu_count() or 1
    processes = max(1, settings.worker_slots or cores)
    pack = settings.pack_across_tiers if settings.pack_across_tiers is not None else processes == 1
    return Budget(processes=processes, threads_per_process=max(1, cores // processes),
                  memory_per_process=int(settings.process_memory_share * machine_memory_bytes()),
                  pack_across_tiers=pack)


def autoscaler(settings: Settings) -> Autoscaler:
    policy = ScalingPolicy(headroom=settings.scale_headroom, drain_target_s=settings.scale_drain_target_s,
                           stabilization_s=settings.scale_down_stabilization_s,
                           max_step_down=settings.scale_max_step_down)
    return Autoscaler(policy=policy, budget=budget(settings), idle=IdlePolicy(idle_s=settings.scale_to_zero_idle_s))
