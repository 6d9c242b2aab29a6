"""Scale to zero (ARCHITECTURE, "Scale to zero") on a real scheduler, its local supervisor and a
real `sluice worker --group` process, through REST: a `min_replicas` 0 version is woken by one job,
which succeeds with `cold_start_ms`; idle for the idle period it releases its placement (its
process drains) and shows `asleep`; a submission then is accepted, not refused, wakes it again and
succeeds, and a job submitted while a worker serves it carries no `cold_start_ms`. The circuit
breaker does not count a waking version's missing worker as a fault."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from scheduler.main import Scheduler, autoscaler, local_supervisor
from scheduler.supervisor import Supervisor
from sluice.registry.store import Registry
from sluice.settings import Settings
from sluice.wire import keys, placements
from sluice.wire.heartbeats import live_since
from sluice.wire.placements import PlacementPlan
from tests.support import FAST_SYNTHETIC, SYNTHETIC_SHA, ApiServer, unique, wait_job, wait_until

pytestmark = pytest.mark.slow

IDLE_S = 5.0


class OnlyGroupsOf:
    """The local actuator for the groups that serve `key`: the session registry's other versions
    (MiniLM among them) are placed too, and starting their processes is not this test's business."""

    def __init__(self, supervisor: Supervisor, key: tuple[str, str]) -> None:
        self.supervisor = supervisor
        self.key = key

    def apply(self, plan: PlacementPlan) -> None:
        self.supervisor.apply(replace(plan, groups={name: group for name, group in plan.groups.items()
                                                    if any(p.key == self.key for p in group.versions)}))

    def reconcile(self) -> None:
        self.supervisor.reconcile()

    def stop_all(self) -> None:
        self.supervisor.stop_all()


@pytest.fixture
def model(admin: httpx.Client) -> str:
    """A batch-tier synthetic model (its own pool of processes: none of the latency tier's MiniLM)
    whose one version has min_replicas 0."""
    name = unique("zero")
    assert admin.post("/v1/models", json={"name": name, "kind": "synthetic", "tier": "batch"}).status_code == 201
    created = admin.post(f"/v1/models/{name}/versions", json={
        "version": "v1", "artifact": f"synthetic:?{FAST_SYNTHETIC}", "sha256": SYNTHETIC_SHA, "state": "stable",
        "min_replicas": 0, "max_replicas": 1})
    assert created.status_code == 201 and created.json()["min_replicas"] == 0, created.text
    assert admin.put(f"/v1/models/{name}/routing", json={"weights": {"v1": 100}}).status_code == 200
    return name


@pytest.fixture
def scheduler(model: str, registry: Registry, redis_url: str, database_url: str, tmp_path: Path,
              seeded: object) -> Iterator[Supervisor]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    env.update({"SLUICE_REDIS_URL": redis_url, "SLUICE_DATABASE_URL": database_url, "SLUICE_HOME": str(tmp_path),
                "SLUICE_SHUTDOWN_GRACE_S": "5", "PYTHONUNBUFFERED": "1"})
    supervisor = local_supervisor(home=tmp_path, env=env, stop_grace_s=10.0)
    runner = Scheduler(registry=registry, redis_url=redis_url, supervisor=OnlyGroupsOf(supervisor, (model, "v1")),
                       autoscaler=autoscaler(Settings(worker_slots=2, scale_to_zero_idle_s=IDLE_S)),
                       refresh_s=0.5)
    thread = threading.Thread(target=runner.run, name="scheduler", daemon=True)
    thread.start()
    try:
        yield supervisor
    finally:
        runner.request_stop()
        thread.join(timeout=30)
    assert not thread.is_alive(), "the scheduler did not stop"


def decision(rds: redis.Redis, model: str) -> dict[str, Any]:
    return rds.hgetall(keys.replicas(model, "v1"))  # type: ignore[return-value]


def placed(rds: redis.Redis, model: str) -> bool:
    plan = placements.read(rds)
    return plan is not None and bool(plan.groups_of((model, "v1")))


def live_workers(rds: redis.Redis, model: str) -> int:
    return int(rds.zcount(keys.live_workers(model, "v1"), live_since(time.time()), "+inf"))


def shown(admin: httpx.Client, model: str) -> dict[str, Any]:
    replicas: dict[str, Any] = admin.get(f"/v1/models/{model}").json()["versions"][0]["replicas"] or {}
    return replicas


def submit_and_wait(demo: httpx.Client, model: str, text: str) -> dict[str, Any]:
    response = demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": text}})
    assert response.status_code == 202, response.text
    return wait_job(demo, response.json()["id"], timeout_s=45)


@pytest.mark.soak
def test_an_idle_min_zero_version_releases_its_worker_and_one_job_wakes_it(
    demo: httpx.Client, admin: httpx.Client, rds: redis.Redis, model: str, scheduler: Supervisor,
) -> None:
    # Nothing queued and no worker: at zero from the first look, and still served.
    wait_until(lambda: decision(rds, model).get("zero") == "asleep", timeout_s=10, what="the version asleep")
    assert not placed(rds, model) and not scheduler.pids()
    assert shown(admin, model)["scale_to_zero"] == "asleep"

    first = submit_and_wait(demo, model, "wake up")
    assert first["status"] == "succeeded", first
    assert first["timings"]["cold_start_ms"] > 0, first["timings"]
    assert first["timings"]["cold_start_ms"] <= first["timings"]["queue_wait_ms"], first["timings"]
    wait_until(lambda: decision(rds, model).get("zero") == "awake", timeout_s=10, what="the version awake")
    assert shown(admin, model)["scale_to_zero"] == "awake"

    # Served by a ready worker: no cold start to report.
    warm = submit_and_wait(demo, model, "already up")
    assert warm["status"] == "succeeded" and "cold_start_ms" not in warm["timings"], warm

    # Idle for the idle period: the placement is released and the process drains away.
    idle_from = time.monotonic()
    wait_until(lambda: decision(rds, model).get("zero") == "asleep", timeout_s=IDLE_S + 10,
               what="the idle version released")
    assert time.monotonic() - idle_from >= IDLE_S - 1.0, "released before its idle period"
    assert not placed(rds, model)
    wait_until(lambda: not scheduler.pids(), timeout_s=15, what="the released group's process gone")
    # A job arriving while the released worker drains may still be read by it (no cold start then):
    # this one comes once it has left.
    wait_until(lambda: not live_workers(rds, model), timeout_s=15, what="the released worker gone")
    asleep = shown(admin, model)
    assert asleep["scale_to_zero"] == "asleep" and asleep["desired"] == 0 and not asleep["not_served"], asleep

    # Asleep is not `not_served`: the job is accepted, wakes the version, and runs.
    again = submit_and_wait(demo, model, "wake up again")
    assert again["status"] == "succeeded" and again["timings"]["cold_start_ms"] > 0, again


def test_a_waking_version_is_not_cut_off_by_its_breaker_for_having_no_worker_yet(
    settings: Settings, admin: httpx.Client, rds: redis.Redis,
) -> None:
    """The breaker's no-worker rule (here after 0.5 s) spares a version whose first worker is
    starting, as the scheduler's decision says, and applies again once it says `awake`."""
    from api.app import create_app

    model = unique("waking")
    assert admin.post("/v1/models", json={"name": model, "kind": "synthetic"}).status_code == 201
    assert admin.post(f"/v1/models/{model}/versions", json={
        "version": "v1", "artifact": f"synthetic:?{FAST_SYNTHETIC}", "sha256": SYNTHETIC_SHA, "state": "stable",
        "min_replicas": 0}).status_code == 201
    rds.hset(keys.replicas(model, "v1"), mapping={"desired": 1, "live": 0, "reason": "woken", "at": "0",
                                                  "zero": "waking"})
    rds.expire(keys.replicas(model, "v1"), 60)
    server = ApiServer(app=create_app(settings=settings.model_copy(update={"breaker_no_worker_grace_s": 0.5})))
    server.start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            def state() -> str:
                breakers = client.get("/readyz").json().get("breakers", {})
                return str(breakers.get(f"{model}/v1", {}).get("state", "unknown"))

            wait_until(lambda: state() == "closed", timeout_s=10, what="the version's breaker judged")
            time.sleep(2.5)
            assert state() == "closed", "a waking version was cut off for having no worker yet"
            rds.hset(keys.replicas(model, "v1"), "zero", "awake")
            wait_until(lambda: state() == "open", timeout_s=10, what="the no-worker rule applying once awake")
    finally:
        server.stop()
