"""`sluice scheduler`: sizes every servable version's worker pool to its load.

Every `scale_interval_s` (and on each routing event) it reads the registry and what Redis shows
of each pool, asks the autoscaler (scheduler/scaling.py, deciding with scheduler/autoscale.py)
for the replicas each version needs within the slot budget, and hands them to an actuator. With
the `local` actuator it supervises worker processes on this machine; with `kubernetes` it sizes each
version's Deployment (scheduler/kubernetes.py); with `none` it only exports
the decisions (metrics, and the `replicas` of `GET /v1/models/{m}`) for KEDA/HPA or compose. The
rollout controller (scheduler/rollout.py) and the quality aggregator (scheduler/quality.py) run
beside it, each on a thread of its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Protocol

import redis

from scheduler.autoscale import ScalingPolicy
from scheduler.quality import run_aggregator
from scheduler.rollout import run_controller
from scheduler.scaling import Autoscaler, publish, read_pools, scaled_versions, withdraw, worker_config
from scheduler.supervisor import Supervisor, VersionKey
from sluice import exposition
from sluice.errors import ActuatorError, BrokerError, SluiceError
from sluice.registry import routing_table
from sluice.registry.store import Registry
from sluice.routing import RoutingSnapshot
from sluice.settings import Settings
from sluice.wire import events
from sluice.wire.connections import connect_sync

log = logging.getLogger(__name__)


def worker_command(python: str = sys.executable) -> Callable[[str, str, int], list[str]]:
    def build(model: str, version: str, threads: int) -> list[str]:
        return [python, "-m", "launch.cli", "worker", "--model", model, "--version", version,
                "--threads", str(threads)]

    return build


class Actuator(Protocol):
    """What carries out the decisions: the local `Supervisor`, or `scheduler/kubernetes.py`'s. `live`
    may raise `ActuatorError`; `set_desired` takes each version on its own and never does, so one
    version's failure neither stops the others' scaling nor the publishing of the decisions."""

    def live(self, key: VersionKey) -> int: ...

    def set_desired(self, desired: Mapping[VersionKey, int], *, configs: Mapping[VersionKey, str] | None = None,
                    ready_pids: Collection[int] = ()) -> None: ...

    def reconcile(self) -> None: ...

    def stop_all(self) -> None: ...


class Scheduler:
    def __init__(self, *, registry: Registry, redis_url: str, supervisor: Actuator | None,
                 autoscaler: Autoscaler, refresh_s: float = 2.0,
                 scrape_target: exposition.ScrapeTarget | None = None) -> None:
        self.registry = registry
        self.redis_url = redis_url
        self.supervisor = supervisor
        self.autoscaler = autoscaler
        self.refresh_s = refresh_s
        self.stopping = threading.Event()
        self._wake = threading.Event()
        self._redis = connect_sync(redis_url)
        self._snapshot: RoutingSnapshot | None = None
        self.scrape_target = scrape_target
        self._advertised_at = 0.0
        self._published: set[VersionKey] = set()  # the versions whose series `publish` set

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
        try:
            readings = read_pools(self._redis, versions, now=time.time())
        except BrokerError as exc:
            log.warning("Redis unreachable, keeping the current pools: %s", exc)
            if self.supervisor:
                self.supervisor.reconcile()
            return

        def live(key: VersionKey) -> int:
            if self.supervisor is None:
                return len(readings[key].beats)
            try:
                return self.supervisor.live(key)
            except ActuatorError as exc:
                # One version's unreadable pool must not stop the others' decisions: its
                # heartbeats are what Redis shows of it.
                log.warning("%s; counting %s/%s's workers by their heartbeats", exc, *key)
                return len(readings[key].beats)

        decisions = self.autoscaler.decide(versions, readings, live=live, now=time.time())
        if self.supervisor:
            self.supervisor.set_desired(
                {key: decision.replicas for key, decision in decisions.items()},
                configs={key: worker_config(scaled.info) for key, scaled in versions.items()},
                ready_pids={beat.pid for reading in readings.values() for beat in reading.ready})
        try:
            publish(self._redis, decisions, readings, live=live)
        except BrokerError as exc:
            log.warning("could not publish the scaling decisions: %s", exc)
        withdraw(self._published - decisions.keys())
        self._published = set(decisions)

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
            if self.scrape_target is not None:
                with contextlib.suppress(BrokerError):
                    exposition.withdraw(self._redis, self.scrape_target)
            self._redis.close()


def local_supervisor(*, home: Path, cores: int | None, slots: int | None, env: dict[str, str] | None = None,
                     stop_grace_s: float = 30.0) -> Supervisor:
    cores = cores or os.cpu_count() or 1
    return Supervisor(command=worker_command(), log_dir=home / "logs", cores=cores, slots=slots or cores,
                      env=env, stop_grace_s=stop_grace_s)


def autoscaler(settings: Settings) -> Autoscaler:
    policy = ScalingPolicy(headroom=settings.scale_headroom, drain_target_s=settings.scale_drain_target_s,
                           stabilization_s=settings.scale_down_stabilization_s,
                           max_step_down=settings.scale_max_step_down)
    return Autoscaler(policy=policy, slots=settings.worker_slots or settings.cpu_cores or os.cpu_count() or 1)
