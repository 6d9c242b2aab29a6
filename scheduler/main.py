"""`sluice scheduler`: keeps every servable version's worker pool at its desired size.

Reads the registry (on each routing event and periodically) and hands the desired counts to an
actuator. With the `local` actuator it supervises worker processes on this machine; with `none`
it only exports the desired counts as metrics (for KEDA/HPA or a compose deployment). The
rollout controller (scheduler/rollout.py) and the quality aggregator (scheduler/quality.py) run
beside it, each on a thread of its own.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import redis

from scheduler.quality import run_aggregator
from scheduler.rollout import run_controller
from scheduler.supervisor import Supervisor, VersionKey
from sluice import events
from sluice.errors import SluiceError
from sluice.metrics import DESIRED_REPLICAS, LIVE_REPLICAS
from sluice.registry import queries
from sluice.registry.store import Registry
from sluice.routing import RoutingSnapshot
from sluice.versions import VersionState

log = logging.getLogger(__name__)


def desired_replicas(snapshot: RoutingSnapshot) -> dict[VersionKey, int]:
    """Every version that can be asked for (all but retired) keeps min_replicas warm."""
    return {
        (model.name, version.version): version.min_replicas
        for model in snapshot.models.values()
        for version in model.versions.values()
        if version.state != VersionState.retired and version.min_replicas > 0
    }


def worker_command(python: str = sys.executable) -> Callable[[str, str, int], list[str]]:
    def build(model: str, version: str, threads: int) -> list[str]:
        return [python, "-m", "launch.cli", "worker", "--model", model, "--version", version,
                "--threads", str(threads)]

    return build


class Scheduler:
    def __init__(self, *, registry: Registry, redis_url: str, supervisor: Supervisor | None,
                 refresh_s: float = 2.0) -> None:
        self.registry = registry
        self.redis_url = redis_url
        self.supervisor = supervisor
        self.refresh_s = refresh_s
        self.stopping = threading.Event()
        self._wake = threading.Event()

    def request_stop(self) -> None:
        self.stopping.set()
        self._wake.set()

    def tick(self) -> None:
        try:
            with self.registry.session() as session:
                snapshot = queries.routing_snapshot(session)
        except SluiceError as exc:
            log.warning("registry unreachable, keeping the current pools: %s", exc)
            if self.supervisor:
                self.supervisor.reconcile()
            return
        desired = desired_replicas(snapshot)
        for (model, version), count in desired.items():
            DESIRED_REPLICAS.labels(model, version).set(count)
        if self.supervisor:
            self.supervisor.set_desired(desired)
            for key in desired:
                LIVE_REPLICAS.labels(*key).set(self.supervisor.live(key))

    def _listen(self) -> None:
        """Wake the loop on routing events so a new version gets workers at once."""
        while not self.stopping.is_set():
            try:
                client = redis.Redis.from_url(self.redis_url, socket_connect_timeout=2)
                pubsub = client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
                pubsub.subscribe(events.channel(client))
                while not self.stopping.is_set():
                    message = pubsub.get_message(timeout=1.0)
                    if message and isinstance(events.parse(message.get("data", b"")), events.RoutingChanged):
                        self._wake.set()
                pubsub.close()
                client.close()
            except (redis.RedisError, OSError):
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


def local_supervisor(*, home: Path, cores: int | None, env: dict[str, str] | None = None,
                     stop_grace_s: float = 30.0) -> Supervisor:
    return Supervisor(command=worker_command(), log_dir=home / "logs", cores=cores or os.cpu_count() or 1,
                      env=env, stop_grace_s=stop_grace_s)
