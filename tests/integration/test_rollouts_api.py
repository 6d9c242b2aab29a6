"""Rollouts as REST resources (ARCHITECTURE, "Rollouts"), and the clients that use them: the Python clients'
admin calls and `sluice rollout` / `sluice stats`, which reach the registry only through the API.

Over the session's real API, Redis and Postgres; no worker runs, so no controller moves a
rollout on and every rollout stays where the API put it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from launch.cli import app
from launch.seed import Seeded
from sluice_client import AsyncClient, Client, ConflictError, InvalidRequest, NotFoundError, SluiceClient
from tests.integration.test_openapi import conforms
from tests.support import SYNTHETIC_SHA, ApiServer, unique

POLICY = {"steps": [2, 20, 100], "soak_s": 120, "min_samples": 100}


@pytest.fixture(scope="module")
def spec(anon: httpx.Client) -> dict[str, Any]:
    body: dict[str, Any] = anon.get("/openapi.json").json()
    return body


def routing(client: httpx.Client, model: str) -> dict[str, float]:
    weights: dict[str, float] = client.get(f"/v1/models/{model}").json()["routing"]
    return weights


def states(client: httpx.Client, model: str) -> dict[str, str]:
    return {v["version"]: v["state"] for v in client.get(f"/v1/models/{model}").json()["versions"]}


def test_a_rollout_is_started_watched_and_aborted_over_rest(
    admin: httpx.Client, register_synthetic: Callable[..., str], spec: dict[str, Any]
) -> None:
    model = register_synthetic("ro", versions=("v1", "v2"))
    started = admin.post(f"/v1/models/{model}/rollouts", json={"canary": "v2", **POLICY, "reason": "int8 candidate"})
    assert started.status_code == 201, started.text
    assert started.headers["Location"] == f"/v1/models/{model}/rollouts/current"
    rollout = started.json()
    conforms(spec, "RolloutResource", rollout)
    assert (rollout["model"], rollout["canary"], rollout["stable"]) == (model, "v2", "v1")
    assert (rollout["state"], rollout["step_index"], rollout["weight"], rollout["finished_at"]) == (
        "running", 0, 2.0, None)
    assert rollout["policy"]["steps"] == [2.0, 20.0, 100.0] and rollout["policy"]["soak_s"] == 120
    assert (rollout["policy"]["min_samples"], rollout["policy"]["min_test_samples"]) == (100, 50)
    [start] = rollout["decisions"]
    assert start["action"] == "start" and start["reason"].endswith(": int8 candidate")
    assert start["evidence"] == {"policy": rollout["policy"]}
    assert routing(admin, model) == {"v1": 98.0, "v2": 2.0}
    assert states(admin, model) == {"v1": "stable", "v2": "canary"}
    newest = admin.get(f"/v1/models/{model}/audit", params={"limit": 1}).json()["entries"][0]
    assert newest["id"] == start["audit_id"] and newest["action"] == "routing.set"
    assert newest["actor"].startswith("key:") and newest["after"] == {"v1": 98.0, "v2": 2.0}
    assert newest["reason"] == f"rollout {rollout['id']}: canary 'v2' at 2 %: int8 candidate"

    again = admin.post(f"/v1/models/{model}/rollouts", json={"canary": "v2"})
    assert again.status_code == 409 and "already has a running rollout" in again.json()["error"]["message"]

    current = admin.get(f"/v1/models/{model}/rollouts/current")
    assert current.status_code == 200, current.text
    assert current.json() == rollout
    assert admin.get(f"/v1/models/{model}/rollouts/current", params={"decisions": 0}).json()["decisions"] == []

    aborted = admin.delete(f"/v1/models/{model}/rollouts/current", params={"reason": "changed my mind"})
    assert aborted.status_code == 200, aborted.text
    conforms(spec, "RolloutResource", aborted.json())
    assert (aborted.json()["state"], aborted.json()["reason"]) == ("aborted", "changed my mind")
    assert aborted.json()["finished_at"] is not None
    assert aborted.json()["decisions"][-1]["action"] == "abort"
    assert aborted.json()["decisions"][-1]["evidence"] == {"restored_weights": {"v1": 100.0}}
    assert routing(admin, model) == {"v1": 100.0}
    assert states(admin, model) == {"v1": "stable", "v2": "stable"}, "the canary's state is restored"
    assert admin.get(f"/v1/models/{model}/rollouts/current").json()["state"] == "aborted"

    none_running = admin.delete(f"/v1/models/{model}/rollouts/current")
    assert none_running.status_code == 409 and "no running rollout" in none_running.json()["error"]["message"]


def test_a_shadow_canary_starts_in_the_shadow_phase(
    admin: httpx.Client, register_synthetic: Callable[..., str]
) -> None:
    model = register_synthetic("rosh", versions=("v1", "v2"), weights={"v1": 100.0, "v2": 20.0})
    assert admin.patch(f"/v1/models/{model}/versions/v2", json={"state": "shadow"}).status_code == 200
    started = admin.post(f"/v1/models/{model}/rollouts", json={"canary": "v2"})
    assert started.status_code == 201, started.text
    assert (started.json()["step_index"], started.json()["weight"]) == (-1, 0.0)
    assert routing(admin, model) == {"v1": 100.0, "v2": 20.0}, "the shadow phase keeps the copy rate"
    assert admin.delete(f"/v1/models/{model}/rollouts/current").status_code == 200


@pytest.mark.parametrize(("body", "status", "message"), [
    ({"canary": "v2", "steps": [5, 1, 100]}, 422, "steps must increase"),
    ({"canary": "v2", "steps": [5, 50]}, 422, "ending at 100"),
    ({"canary": "v2", "steps": [100]}, 422, "steps"),
    ({"canary": "v2", "steps": [0, 100]}, 422, "steps"),
    ({"canary": "v2", "soak_s": -1}, 422, "soak_s"),
    ({"canary": "v2", "min_samples": 0}, 422, "min_samples"),
    ({"canary": "v2", "alpha": 0.5}, 422, "alpha"),
    ({}, 422, "canary"),
    ({"canary": "v9"}, 404, "no version 'v9'"),
    ({"canary": "v2", "stable": "v9"}, 404, "no version 'v9'"),
    ({"canary": "v1", "stable": "v1"}, 400, "must differ"),
])
def test_a_start_that_cannot_be_is_refused_and_changes_nothing(
    admin: httpx.Client, register_synthetic: Callable[..., str], body: dict[str, Any], status: int, message: str
) -> None:
    model = register_synthetic("robad", versions=("v1", "v2"))
    refused = admin.post(f"/v1/models/{model}/rollouts", json=body)
    assert refused.status_code == status, refused.text
    assert message in refused.json()["error"]["message"]
    assert routing(admin, model) == {"v1": 100.0}
    assert admin.get(f"/v1/models/{model}/rollouts/current").status_code == 404


def test_unknown_models_and_models_without_rollouts_are_404(
    admin: httpx.Client, register_synthetic: Callable[..., str]
) -> None:
    ghost = unique("ghost")
    assert admin.post(f"/v1/models/{ghost}/rollouts", json={"canary": "v2"}).status_code == 404
    assert admin.get(f"/v1/models/{ghost}/rollouts/current").status_code == 404
    assert admin.delete(f"/v1/models/{ghost}/rollouts/current").status_code == 404
    never = register_synthetic("ronever")
    missing = admin.get(f"/v1/models/{never}/rollouts/current")
    assert missing.status_code == 404 and "has no rollout" in missing.json()["error"]["message"]
    assert admin.get(f"/v1/models/{never}/rollouts/current", params={"decisions": 1001}).status_code == 422
    assert admin.get("/v1/models/a%00b/rollouts/current").status_code == 400, "a NUL is no outage"


def test_rollouts_need_an_admin_key(
    admin: httpx.Client, demo: httpx.Client, anon: httpx.Client, register_synthetic: Callable[..., str]
) -> None:
    model = register_synthetic("roauth", versions=("v1", "v2"))
    assert demo.post(f"/v1/models/{model}/rollouts", json={"canary": "v2"}).status_code == 403
    assert anon.post(f"/v1/models/{model}/rollouts", json={"canary": "v2"}).status_code == 401
    assert admin.post(f"/v1/models/{model}/rollouts", json={"canary": "v2"}).status_code == 201
    assert demo.get(f"/v1/models/{model}/rollouts/current").status_code == 403
    assert demo.delete(f"/v1/models/{model}/rollouts/current").status_code == 403
    assert routing(admin, model) == {"v1": 99.0, "v2": 1.0}
    assert admin.delete(f"/v1/models/{model}/rollouts/current").status_code == 200


# --- the Python clients --------------------------------------------------------------------------------


def test_the_sync_client_makes_every_admin_call(api: ApiServer, seeded: Seeded) -> None:
    assert Client is SluiceClient
    model, tenant = unique("cl"), unique("clt")
    with Client(base_url=api.url, api_key=seeded.admin_key) as client:
        assert client.create_model(model, "synthetic", tier="batch")["tier"] == "batch"
        for version in ("v1", "v2"):
            created = client.create_version(model, version, artifact="synthetic:?fixed_s=0.001", sha256=SYNTHETIC_SHA,
                                            state="stable", min_replicas=0)
            assert created["version"] == version and created["min_replicas"] == 0
        assert client.set_routing(model, {"v1": 100.0}, reason="first")["routing"] == {"v1": 100.0}
        changed = client.update_version(model, "v2", max_replicas=2, reason="smaller")
        assert changed["max_replicas"] == 2 and changed["audit"]["reason"] == "smaller"

        rollout = client.start_rollout(model, "v2", steps=[10, 100], soak_s=0, min_samples=5, reason="cl")
        assert (rollout["weight"], rollout["policy"]["min_test_samples"]) == (10.0, 5)
        with pytest.raises(ConflictError):
            client.start_rollout(model, "v2")
        with pytest.raises(InvalidRequest, match="steps must increase"):
            client.start_rollout(model, "v2", steps=[50, 10, 100])
        assert client.rollout(model, decisions=0)["decisions"] == []
        assert client.abort_rollout(model, reason="enough")["state"] == "aborted"
        with pytest.raises(ConflictError):
            client.abort_rollout(model)
        assert client.model(model)["routing"] == {"v1": 100.0}
        assert model in {m["name"] for m in client.models()}

        stats = client.stats(model, "v1", window_s=60)
        assert (stats["count"], stats["window_s"]) == (0, 60)
        assert client.quality(model, "v1", hours=1) == {"model": model, "version": "v1", "windows": []}
        entries = client.audit(model, limit=2)
        assert len(entries) == 2 and entries[0]["id"] > entries[1]["id"]
        assert client.audit(model, limit=1, before=entries[1]["id"])[0]["id"] < entries[1]["id"]
        assert list(client.rollback(model, reason="by hand")["routing"].values()) == [100.0]

        made = client.create_tenant(tenant, rate_limit_per_s=5)
        assert made["id"] == tenant and made["key"]["secret"]
        assert client.set_share(tenant, 3, reason="larger contract") == {"id": tenant, "share": 3.0}
        issued = client.issue_key(tenant)
        assert (issued["tenant"], issued["admin"]) == (tenant, False)
        assert client.pin(tenant, model, "v2")["version"] == "v2"
        assert client.unpin(tenant, model)["version"] is None
        assert client.revoke_key(issued["id"]) == {"id": issued["id"], "revoked": True}
        rotated = client.rotate_webhook_secret(tenant, reason="yearly")
        assert rotated["webhook_secret"] != made["webhook_secret"] and rotated["audit"]["reason"] == "yearly"
        given = "a-secret-given-by-the-operator-01"
        assert client.rotate_webhook_secret(tenant, secret=given, overlap_s=0)["previous_until"] is None
        with pytest.raises(InvalidRequest):
            client.rotate_webhook_secret(tenant, secret="short")
        with pytest.raises(NotFoundError):
            client.rollout(unique("ghost"))


async def test_the_async_client_makes_the_same_calls(api: ApiServer, seeded: Seeded) -> None:
    model, tenant = unique("acl"), unique("aclt")
    async with AsyncClient(base_url=api.url, api_key=seeded.admin_key) as client:
        await client.create_model(model, "synthetic")
        for version in ("v1", "v2"):
            await client.create_version(model, version, artifact="synthetic:?fixed_s=0.001", sha256=SYNTHETIC_SHA,
                                        state="stable", min_replicas=0)
        await client.set_routing(model, {"v1": 100.0})
        await client.update_version(model, "v2", state="staged")
        rollout = await client.start_rollout(model, "v2", stable="v1", steps=[25, 100])
        assert (rollout["weight"], (await client.model(model))["routing"]) == (25.0, {"v1": 75.0, "v2": 25.0})
        assert (await client.rollout(model))["id"] == rollout["id"]
        assert (await client.abort_rollout(model))["state"] == "aborted"
        assert (await client.model(model))["routing"] == {"v1": 100.0}
        assert model in {m["name"] for m in await client.models()}
        assert (await client.stats(model, "v1"))["window_s"] == 300
        assert (await client.quality(model, "v1"))["windows"] == []
        assert (await client.audit(model, limit=1))[0]["reason"] == f"rollout {rollout['id']} aborted"
        assert list((await client.rollback(model))["routing"].values()) == [100.0]
        key = (await client.create_tenant(tenant, share=2))["key"]
        assert (await client.set_share(tenant, 0.5))["share"] == 0.5
        assert (await client.pin(tenant, model, "v1"))["version"] == "v1"
        assert (await client.unpin(tenant, model))["version"] is None
        assert (await client.issue_key(tenant, admin=False))["tenant"] == tenant
        assert (await client.revoke_key(key["id"]))["revoked"]
        assert (await client.rotate_webhook_secret(tenant, overlap_s=60))["previous_until"]


def test_events_yield_the_job_at_each_state_change(
    api: ApiServer, seeded: Seeded, register_synthetic: Callable[..., str]
) -> None:
    model = register_synthetic("ev")  # no worker: the job stays queued until cancelled
    with SluiceClient(base_url=api.url, api_key=seeded.demo_key) as client:
        job = client.submit(model, {"text": "hello"})
        seen: list[dict[str, Any]] = []
        first = threading.Event()

        def follow() -> None:
            for event in client.events(job["id"]):
                seen.append(event)
                first.set()

        reader = threading.Thread(target=follow)
        reader.start()
        assert first.wait(10), "the current state comes first"
        client.cancel(job["id"])
        reader.join(10)
        assert not reader.is_alive(), "the stream ends at a final state"
        assert [(e["id"], e["status"]) for e in seen] == [(job["id"], "queued"), (job["id"], "cancelled")]
        assert [e["status"] for e in client.events(job["id"])] == ["cancelled"]
        with pytest.raises(NotFoundError):
            list(client.events("job_unknown"))


async def test_async_events_end_at_the_final_state(
    api: ApiServer, seeded: Seeded, register_synthetic: Callable[..., str]
) -> None:
    model = register_synthetic("aev")
    async with AsyncClient(base_url=api.url, api_key=seeded.demo_key) as client:
        job = await client.submit(model, {"text": "hello"})
        await client.cancel(job["id"])
        assert [e["status"] async for e in client.events(job["id"])] == ["cancelled"]
        with pytest.raises(NotFoundError):
            [e async for e in client.events("job_unknown")]


# --- the command line ----------------------------------------------------------------------------------


def test_the_cli_starts_shows_and_aborts_a_rollout_through_the_api(
    api: ApiServer, seeded: Seeded, admin: httpx.Client, register_synthetic: Callable[..., str]
) -> None:
    model = register_synthetic("rocli", versions=("v1", "v2"))
    runner = CliRunner()
    # No SLUICE_DATABASE_URL: the commands reach nothing but the API.
    env = {"SLUICE_URL": api.url, "SLUICE_API_KEY": seeded.admin_key, "SLUICE_DATABASE_URL": None,
           "SLUICE_REDIS_URL": None}
    started = runner.invoke(
        app, ["rollout", "start", model, "v2", "--steps", "2,20,100", "--soak-s", "120", "--min-samples", "100"],
        env=env)
    assert started.exit_code == 0, started.output
    assert "'v2' against 'v1', starting at 2 %" in started.output
    assert routing(admin, model) == {"v1": 98.0, "v2": 2.0}

    status = runner.invoke(app, ["rollout", "status", model, "--json"], env=env)
    assert status.exit_code == 0, status.output
    body = json.loads(status.output)
    assert (body["state"], body["weight"], body["stable"]) == ("running", 2.0, "v1")
    assert body["policy"]["steps"] == [2.0, 20.0, 100.0] and body["policy"]["soak_s"] == 120
    assert [d["action"] for d in body["decisions"]] == ["start"]
    assert body["decisions"][0]["audit_id"] is not None

    again = runner.invoke(app, ["rollout", "start", model, "v2"], env=env)
    assert again.exit_code == 1 and "already has a running rollout" in again.output
    bad = runner.invoke(app, ["rollout", "start", model, "v2", "--steps", "5,1,100"], env=env)
    assert bad.exit_code == 2 and "steps must increase" in bad.output
    words = runner.invoke(app, ["rollout", "start", model, "v2", "--steps", "five,100"], env=env)
    assert words.exit_code == 2 and "comma-separated numbers" in words.output

    aborted = runner.invoke(app, ["rollout", "abort", model, "--reason", "test"], env=env)
    assert aborted.exit_code == 0, aborted.output
    assert "weights restored to {'v1': 100.0}" in aborted.output
    assert routing(admin, model) == {"v1": 100.0}
    shown = runner.invoke(app, ["rollout", "status", model], env=env)
    assert shown.exit_code == 0 and "aborted" in shown.output and "abort" in shown.output
    missing = runner.invoke(app, ["rollout", "abort", model], env=env)
    assert missing.exit_code == 1 and "no running rollout" in missing.output
    tenant = runner.invoke(app, ["rollout", "status", model, "--url", api.url, "--key", seeded.demo_key])
    assert tenant.exit_code == 1 and "needs an admin key" in tenant.output


def test_the_cli_prints_a_versions_stats(
    api: ApiServer, seeded: Seeded, admin: httpx.Client, register_synthetic: Callable[..., str]
) -> None:
    model = register_synthetic("stcli", versions=("v1", "v2"))
    env = {"SLUICE_URL": api.url, "SLUICE_API_KEY": seeded.admin_key, "COLUMNS": "160"}
    shown = CliRunner().invoke(app, ["stats", model, "v1", "--window-s", "60"], env=env)
    assert shown.exit_code == 0, shown.output
    assert f"{model} v1 over 60 s" in shown.output
    rows = {line.split("│")[1].strip(): [cell.strip() for cell in line.split("│")[2:-1]]
            for line in shown.output.splitlines() if line.count("│") >= 3}
    assert rows["jobs"] == ["0"] and rows["errors"] == ["0 (0.00%)"]
    assert rows["queue wait ms p50"] == ["-"] and rows["batches closed on"] == ["size 0, age 0, drain 0"]
    # Without a version: every version not retired, side by side.
    both = CliRunner().invoke(app, ["stats", model], env=env)
    assert both.exit_code == 0, both.output
    assert f"{model} v1, v2 over 300 s" in both.output
    as_json = CliRunner().invoke(app, ["stats", model, "--json"], env=env)
    assert as_json.exit_code == 0, as_json.output
    assert json.loads(as_json.output) == {
        version: admin.get(f"/v1/models/{model}/versions/{version}/stats").json() for version in ("v1", "v2")}
    unknown = CliRunner().invoke(app, ["stats", model, "v9"], env=env)
    assert unknown.exit_code == 1 and "no version 'v9'" in unknown.output
