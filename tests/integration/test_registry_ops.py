"""Version changes, rollback and per-version stats through the REST API."""

from __future__ import annotations

import gc
import threading
import warnings
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from sluice.registry.store import Registry
from tests.conftest import WorkerProcess


def test_patch_retires_a_version_and_rollback_restores_stable(
    admin: httpx.Client, demo: httpx.Client, register_synthetic: Callable[..., str]
) -> None:
    model = register_synthetic("ops", versions=("v1", "v2"), weights={"v1": 50, "v2": 50})
    patched = admin.patch(f"/v1/models/{model}/versions/v2", json={"state": "canary", "reason": "try v2"})
    assert patched.status_code == 200, patched.text
    assert patched.json()["state"] == "canary"
    assert patched.json()["audit"]["before"]["state"] == "stable"

    rolled = admin.post(f"/v1/models/{model}/rollback", json={"reason": "canary misbehaves"})
    assert rolled.status_code == 200, rolled.text
    assert rolled.json()["routing"] == {"v1": 100.0}
    assert rolled.json()["audit"]["before"] == {"v1": 50.0, "v2": 50.0}

    retired = admin.patch(f"/v1/models/{model}/versions/v2", json={"state": "retired"})
    assert retired.status_code == 200
    explicit = demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": "x"}, "version": "v2"})
    assert explicit.status_code == 409, explicit.text
    assert admin.patch(f"/v1/models/{model}/versions/v2", json={"state": "bogus"}).status_code == 422
    assert demo.patch(f"/v1/models/{model}/versions/v1", json={"state": "retired"}).status_code == 403


def test_rollback_without_a_stable_version_is_a_conflict(
    admin: httpx.Client, register_synthetic: Callable[..., str]
) -> None:
    model = register_synthetic("nostable")
    assert admin.patch(f"/v1/models/{model}/versions/v1", json={"state": "canary"}).status_code == 200
    response = admin.post(f"/v1/models/{model}/rollback")
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "conflict"


@pytest.mark.slow
def test_stats_are_exact_per_version(
    demo: httpx.Client, admin: httpx.Client, register_synthetic: Callable[..., str],
    start_worker: Callable[..., WorkerProcess], wait_jobs: Callable[..., list[dict[str, Any]]],
) -> None:
    model = register_synthetic("stats", max_batch_size=8)
    start_worker(model)
    inputs = [{"text": f"item {i}"} for i in range(40)] + [{"text": "__poison__"}]
    ids = demo.post(f"/v1/models/{model}/jobs:bulk", json={"inputs": inputs}).json()["ids"]
    jobs = wait_jobs(demo, ids)
    stats = admin.get(f"/v1/models/{model}/versions/v1/stats", params={"window_s": 600}).json()
    assert stats["count"] == 41
    assert stats["errors"] == 1 == sum(1 for j in jobs if j["status"] == "failed")
    assert stats["error_rate"] == pytest.approx(1 / 41, abs=1e-6)
    waits = sorted(j["timings"]["queue_wait_ms"] for j in jobs)
    # The median of 41 values is the 21st (type 7). The mean of the 20th and 21st equalled it only
    # while those two jobs ran in one batch, since jobs of one bulk and one batch share a wait.
    assert stats["queue_wait_ms"]["p50"] == pytest.approx(waits[20], abs=0.01)
    assert max(int(size) for size in stats["batch_size"]["histogram"]) <= 8
    assert sum(stats["close_reasons"].values()) == sum(stats["batch_size"]["histogram"].values())
    unknown = admin.get(f"/v1/models/{model}/versions/v2/stats")
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "not_found"


def test_the_model_resource_shows_the_scheduler_s_decision_per_version(
    demo: httpx.Client, register_synthetic: Callable[..., str], rds: Any
) -> None:
    from sluice.wire import keys

    model = register_synthetic("scaled", versions=("v1", "v2"))
    reason = "online 12.0/s forecast 8.0s ahead, backlog 40 (40 by then); 2 ready at 9.5/s each: 1.71 replicas"
    rds.hset(keys.replicas(model, "v1"), mapping={"desired": 2, "live": 1, "reason": reason, "at": "0"})
    rds.expire(keys.replicas(model, "v1"), 60)
    response = demo.get(f"/v1/models/{model}")
    assert response.status_code == 200, response.text
    versions = {v["version"]: v for v in response.json()["versions"]}
    assert versions["v1"]["replicas"] == {"desired": 2, "live": 1, "reason": reason, "processes": [],
                                          "not_served": None, "scale_to_zero": None}
    # No scheduler decided for v2 (or none in the last minute): nothing made up.
    assert versions["v2"]["replicas"] is None
    listed = next(m for m in demo.get("/v1/models").json()["models"] if m["name"] == model)
    assert [v["replicas"] for v in listed["versions"]] == [versions["v1"]["replicas"], None]


def test_a_model_has_an_availability_tier_set_at_creation_or_by_a_version_patch(
    admin: httpx.Client, demo: httpx.Client, seeded: Any, api: Any, registry: Any
) -> None:
    from sqlalchemy import select
    from typer.testing import CliRunner

    from launch.cli import app
    from sluice.registry.tables import AuditEntry
    from tests.support import unique

    name = unique("tiered")
    created = admin.post("/v1/models", json={"name": name, "kind": "synthetic", "tier": "batch"})
    assert created.status_code == 201, created.text
    assert created.json()["tier"] == "batch"
    assert admin.post("/v1/models", json={"name": unique("t"), "kind": "synthetic", "tier": "gold"}).status_code == 422
    plain = admin.post("/v1/models", json={"name": unique("plain"), "kind": "synthetic"})
    assert plain.json()["tier"] == "latency"

    registered = admin.post(f"/v1/models/{name}/versions", json={
        "version": "v1", "artifact": "synthetic:?fixed_s=0.001", "sha256": "0" * 64, "state": "stable"})
    assert registered.status_code == 201, registered.text
    patched = admin.patch(f"/v1/models/{name}/versions/v1",
                          json={"tier": "latency", "min_replicas": 2, "max_replicas": 5, "reason": "now interactive"})
    assert patched.status_code == 200, patched.text
    assert (patched.json()["min_replicas"], patched.json()["max_replicas"]) == (2, 5)
    shown = demo.get(f"/v1/models/{name}").json()
    assert shown["tier"] == "latency"
    with registry.session() as session:
        audit = [(e.action, e.after) for e in session.scalars(select(AuditEntry).where(AuditEntry.model == name))]
    assert ("model.tier", {"tier": "latency"}) in audit, audit
    assert demo.patch(f"/v1/models/{name}/versions/v1", json={"tier": "batch"}).status_code == 403

    listed = CliRunner().invoke(app, ["models", "--url", api.url, "--key", seeded.demo_key])
    assert listed.exit_code == 0, listed.output
    latency_line = next(line for line in listed.output.splitlines() if line.startswith("latency tier:"))
    assert name in latency_line
    assert f"{name} v1 (stable" in listed.output


def test_the_audit_log_of_a_model_is_a_rest_resource_newest_first(
    admin: httpx.Client, demo: httpx.Client, register_synthetic: Callable[..., str]
) -> None:
    model = register_synthetic("audited", versions=("v1", "v2"))
    assert admin.put(f"/v1/models/{model}/routing", json={"weights": {"v1": 90, "v2": 10},
                                                           "reason": "canary by hand"}).status_code == 200
    assert admin.patch(f"/v1/models/{model}/versions/v2", json={"state": "canary"}).status_code == 200
    response = admin.get(f"/v1/models/{model}/audit")
    assert response.status_code == 200, response.text
    entries = response.json()["entries"]
    assert [e["action"] for e in entries[:2]] == ["version.update", "routing.set"]
    assert entries[1]["after"] == {"v1": 90.0, "v2": 10.0} and entries[1]["reason"] == "canary by hand"
    assert [e["id"] for e in entries] == sorted((e["id"] for e in entries), reverse=True)
    older = admin.get(f"/v1/models/{model}/audit", params={"before": entries[0]["id"], "limit": 1}).json()["entries"]
    assert [e["id"] for e in older] == [entries[1]["id"]]
    assert demo.get(f"/v1/models/{model}/audit").status_code == 403
    assert admin.get("/v1/models/no-such-model/audit").status_code == 404
    assert admin.get(f"/v1/models/{model}/audit", params={"before": 2**63}).status_code == 422


def test_a_version_s_quality_windows_are_a_rest_resource(
    admin: httpx.Client, register_synthetic: Callable[..., str], registry: Any
) -> None:
    import time

    from sluice.registry import quality

    model = register_synthetic("quality")
    with registry.session() as session:
        for minutes_ago in (30, 20):
            quality.record_window(session, model=model, version="v1", window_start=time.time() - 60 * minutes_ago,
                                  window_s=600, count=100, errors=2, metrics={"top_p_mean": 0.9})
    response = admin.get(f"/v1/models/{model}/versions/v1/quality", params={"hours": 1})
    assert response.status_code == 200, response.text
    body = response.json()
    assert (body["model"], body["version"]) == (model, "v1")
    assert [(w["count"], w["errors"], w["metrics"]) for w in body["windows"]] == [(100, 2, {"top_p_mean": 0.9})] * 2
    assert body["windows"][0]["window_start"] < body["windows"][1]["window_start"]
    recent = admin.get(f"/v1/models/{model}/versions/v1/quality", params={"hours": 0.4}).json()["windows"]  # 24 minutes
    assert len(recent) == 1
    assert admin.get(f"/v1/models/{model}/versions/v9/quality").status_code == 404
    assert admin.get(f"/v1/models/{model}/versions/v1/quality", params={"hours": 0}).status_code == 422


def test_a_query_still_running_when_the_registry_is_disposed_leaves_no_connection_open(database_url: str) -> None:
    # An API's shutdown disposes its registry while a routing refresh may still be querying in a
    # thread; that connection comes back after dispose() replaced the pool.
    registry = Registry(url=database_url, pool_size=1)
    started = threading.Event()

    def slow_query() -> None:
        with registry.session() as session:
            started.set()
            session.execute(text("SELECT pg_sleep(0.3)"))

    thread = threading.Thread(target=slow_query)
    thread.start()
    assert started.wait(5)
    registry.dispose()
    thread.join(5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gc.collect()  # the pool dispose() replaced, with what came back into it
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
