"""Cron schedules over the API, and the dispatcher's one batch per due slot."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from croniter import croniter

from launch.seed import Seeded
from sluice.registry import batches as queries
from sluice.registry import tenants
from sluice.registry.store import Registry
from sluice.registry.tables import Schedule
from sluice.settings import Settings
from workers.schedules import dispatch_due

pytestmark = pytest.mark.usefixtures("batches_ended_after")


def _schedule(admin: httpx.Client, settings: Settings, model: str, **extra: Any) -> dict[str, Any]:
    assert settings.batch_root is not None
    body = {"model": model, "cron": "0 2 * * *", "timezone": "Europe/Paris",
            "input_uri": f"{model}/{{date}}.jsonl", **extra}
    response = admin.post("/v1/schedules", json=body)
    assert response.status_code == 201, response.text
    return response.json()


def test_a_schedule_is_created_listed_and_deleted_by_an_admin(
    admin: httpx.Client, demo: httpx.Client, settings: Settings, register_synthetic: Callable[..., str]
) -> None:
    model = register_synthetic("sched")
    created = _schedule(admin, settings, model)
    assert created["tenant"] == "admin" and created["timezone"] == "Europe/Paris"
    # 02:00 in Paris is 00:00 or 01:00 UTC, by the season.
    assert created["next_run_at"].endswith(("T00:00:00Z", "T01:00:00Z"))
    assert created["id"] in {s["id"] for s in admin.get("/v1/schedules").json()["schedules"]}
    assert admin.get(f"/v1/schedules/{created['id']}").json() == created
    assert demo.get("/v1/schedules").status_code == 403
    assert demo.post("/v1/schedules", json={"model": model, "cron": "* * * * *", "input_uri": "file:///x"}
                     ).status_code == 403
    assert admin.delete(f"/v1/schedules/{created['id']}").json()["id"] == created["id"]
    assert admin.get(f"/v1/schedules/{created['id']}").status_code == 404
    assert admin.delete(f"/v1/schedules/{created['id']}").status_code == 404


@pytest.mark.parametrize(("change", "status"), [
    ({"cron": "every night"}, 422),
    ({"cron": "61 * * * *"}, 422),
    ({"timezone": "Mars/Olympus"}, 422),
    ({"input_uri": "file:///etc/{date}.jsonl"}, 422),
    ({"input_uri": "s3://bucket/{date}.jsonl"}, 422),
    ({"input_uri": "ROOT/{nonsense}.jsonl"}, 422),
    ({"output_uri": "file:///tmp/out.jsonl"}, 422),
    ({"model": "no-such-model"}, 404),
    ({"tenant": "no-such-tenant"}, 404),
    ({"format": "xlsx"}, 422),
    ({"input_uri": "ROOT/in%00/{date}.jsonl"}, 422),
    ({"input_uri": "ROOT/in\u0000.jsonl"}, 422),
    ({"output_uri": "ROOT/out%00.jsonl"}, 422),
])
def test_a_bad_schedule_is_refused(admin: httpx.Client, settings: Settings, register_synthetic: Callable[..., str],
                                   change: dict[str, Any], status: int) -> None:
    assert settings.batch_root is not None
    model = register_synthetic("badsched")
    body = {"model": model, "cron": "0 2 * * *", "input_uri": "{date}.jsonl"}
    body.update({k: v.replace("ROOT", (settings.batch_root / "tenants" / "admin").as_uri()) if isinstance(v, str) else v
                 for k, v in change.items()})
    response = admin.post("/v1/schedules", json=body)
    assert response.status_code == status, response.text


def test_each_due_slot_becomes_one_batch_however_many_dispatchers_run(
    admin: httpx.Client, settings: Settings, registry: Registry, register_synthetic: Callable[..., str]
) -> None:
    assert settings.batch_root is not None
    model = register_synthetic("slots")
    created = _schedule(admin, settings, model, cron="*/10 * * * *", timezone="UTC", output_format="csv")
    folder = settings.batch_root / "tenants" / "admin" / model
    folder.mkdir(parents=True, exist_ok=True)
    start = datetime.now(UTC).replace(second=0, microsecond=0)
    iterator = croniter("*/10 * * * *", start - timedelta(hours=1))
    slots = [iterator.get_next(datetime) for _ in range(6)]
    # Every slot's own date: within an hour of midnight the slots span two days.
    for slot in slots:
        (folder / f"{slot:%Y-%m-%d}.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    with registry.session() as session:
        row = session.get(Schedule, created["id"])
        assert row is not None
        row.next_slot = slots[0]
    now = slots[-1]
    made: list[list[str]] = []

    def dispatch() -> None:
        made.append(dispatch_due(registry, batch_root=settings.batch_root, now=now))

    threads = [threading.Thread(target=dispatch) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    dispatch()
    assert sorted(len(ids) for ids in made) == [0, 0, 0, 0, 6]
    runs = admin.get("/v1/batches", params={"schedule_id": created["id"]}).json()["batches"]
    assert sorted(run["slot"] for run in runs) == [s.isoformat().replace("+00:00", "Z") for s in slots]
    assert {run["status"] for run in runs} == {"queued"}
    assert {run["output"]["format"] for run in runs} == {"csv"}
    assert admin.get(f"/v1/schedules/{created['id']}").json()["next_run_at"] > now.isoformat()[:19]


def test_a_slot_whose_input_is_missing_is_a_failed_run_that_says_why(
    admin: httpx.Client, settings: Settings, registry: Registry, register_synthetic: Callable[..., str]
) -> None:
    model = register_synthetic("missing")
    created = _schedule(admin, settings, model, cron="0 * * * *", timezone="UTC")
    slot = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - timedelta(hours=1)
    with registry.session() as session:
        row = session.get(Schedule, created["id"])
        assert row is not None
        row.next_slot = slot
    [batch_id] = dispatch_due(registry, batch_root=settings.batch_root, now=slot + timedelta(minutes=1))
    run = admin.get(f"/v1/batches/{batch_id}").json()
    assert run["status"] == "failed" and "no such batch file" in run["error"] and run["finished_at"]
    with registry.session() as session:
        assert queries.get_batch(session, batch_id).schedule_id == created["id"]


def test_an_input_uri_with_a_nul_byte_is_refused_at_submit(demo: httpx.Client, settings: Settings,
                                                           register_synthetic: Callable[..., str]) -> None:
    assert settings.batch_root is not None
    model = register_synthetic("nul")
    for uri, says in ((f"{settings.batch_root.as_uri()}/in%00.jsonl", "NUL"),
                      (f"{settings.batch_root.as_uri()}/in\u0000.jsonl", "U+0000")):
        response = demo.post("/v1/batches", json={"model": model, "input_uri": uri})
        assert response.status_code == 422, response.text
        assert says in response.json()["error"]["message"]


def _due(registry: Registry, schedule_id: str, slot: datetime, **changes: Any) -> None:
    with registry.session() as session:
        row = session.get(Schedule, schedule_id)
        assert row is not None
        row.next_slot = slot
        for name, value in changes.items():
            setattr(row, name, value)


def test_a_slot_whose_input_path_cannot_be_resolved_fails_alone(
    admin: httpx.Client, settings: Settings, registry: Registry, register_synthetic: Callable[..., str]
) -> None:
    """A symlink loop where the input should be: that run fails; the other schedules' runs are made."""
    assert settings.batch_root is not None
    admins = settings.batch_root / "tenants" / "admin"
    looping, healthy = register_synthetic("loop"), register_synthetic("healthy")
    broken = _schedule(admin, settings, looping, cron="0 * * * *", timezone="UTC")
    working = _schedule(admin, settings, healthy, cron="0 * * * *", timezone="UTC")
    slot = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - timedelta(hours=1)
    (admins / looping).mkdir(parents=True, exist_ok=True)
    (admins / healthy).mkdir(parents=True, exist_ok=True)
    (admins / looping / f"{slot:%Y-%m-%d}.jsonl").symlink_to(admins / looping / "loop")
    (admins / looping / "loop").symlink_to(admins / looping / f"{slot:%Y-%m-%d}.jsonl")
    (admins / healthy / f"{slot:%Y-%m-%d}.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    # The broken one first: it used to stop the dispatch before the others were reached.
    _due(registry, broken["id"], slot - timedelta(hours=1))
    _due(registry, working["id"], slot)
    dispatch_due(registry, batch_root=settings.batch_root, now=slot + timedelta(minutes=1))
    [good] = admin.get("/v1/batches", params={"schedule_id": working["id"]}).json()["batches"]
    assert good["status"] == "queued"
    runs = admin.get("/v1/batches", params={"schedule_id": broken["id"]}).json()["batches"]
    assert len(runs) == 2 and {run["status"] for run in runs} == {"failed"}
    assert all(run["error"] for run in runs)
    assert admin.get(f"/v1/schedules/{broken['id']}").json()["next_run_at"] > slot.isoformat()[:19]


def test_a_schedule_that_cannot_be_dispatched_records_why_and_the_others_go_on(
    admin: httpx.Client, settings: Settings, registry: Registry, register_synthetic: Callable[..., str]
) -> None:
    """A schedule whose time zone this host no longer knows (tzdata drops and renames zones)."""
    assert settings.batch_root is not None
    admins = settings.batch_root / "tenants" / "admin"
    stale, healthy = register_synthetic("stalezone"), register_synthetic("goes-on")
    broken = _schedule(admin, settings, stale, cron="0 * * * *", timezone="UTC")
    working = _schedule(admin, settings, healthy, cron="0 * * * *", timezone="UTC")
    assert broken["last_error"] is None and broken["last_error_at"] is None
    slot = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - timedelta(hours=1)
    for model in (stale, healthy):
        (admins / model).mkdir(parents=True, exist_ok=True)
        (admins / model / f"{slot:%Y-%m-%d}.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    _due(registry, broken["id"], slot - timedelta(hours=1), timezone="Mars/Olympus")
    _due(registry, working["id"], slot)
    now = slot + timedelta(minutes=1)
    dispatch_due(registry, batch_root=settings.batch_root, now=now)
    assert len(admin.get("/v1/batches", params={"schedule_id": working["id"]}).json()["batches"]) == 1
    assert admin.get("/v1/batches", params={"schedule_id": broken["id"]}).json()["batches"] == []
    failing = admin.get(f"/v1/schedules/{broken['id']}").json()
    assert "Mars/Olympus" in failing["last_error"] and failing["last_error_at"]
    # Not advanced: once the schedule can be read again, its slots run, late but once each.
    assert failing["next_run_at"] == (slot - timedelta(hours=1)).isoformat().replace("+00:00", "Z")
    _due(registry, broken["id"], slot - timedelta(hours=1), timezone="UTC")
    dispatch_due(registry, batch_root=settings.batch_root, now=now)
    assert len(admin.get("/v1/batches", params={"schedule_id": broken["id"]}).json()["batches"]) == 2
    recovered = admin.get(f"/v1/schedules/{broken['id']}").json()
    assert recovered["last_error"] is None and recovered["last_error_at"] is None


def test_an_admin_cancels_a_tenant_s_scheduled_run_and_the_audit_log_says_so(
    admin: httpx.Client, settings: Settings, registry: Registry, seeded: Seeded,
    register_synthetic: Callable[..., str], new_tenant: Callable[..., tuple[str, httpx.Client]],
) -> None:
    assert settings.batch_root is not None
    model = register_synthetic("adminc")
    owner, owner_client = new_tenant("owner")
    _, stranger = new_tenant("stranger")
    created = _schedule(admin, settings, model, cron="0 * * * *", timezone="UTC", tenant=owner)
    slot = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - timedelta(hours=1)
    folder = settings.batch_root / "tenants" / owner / model
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{slot:%Y-%m-%d}.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    _due(registry, created["id"], slot)
    [batch_id] = dispatch_due(registry, batch_root=settings.batch_root, now=slot + timedelta(minutes=1))
    assert owner_client.get(f"/v1/batches/{batch_id}").json()["status"] == "queued"

    # Another tenant's key: the answer of a batch that does not exist, word for word.
    missing = "bat_" + "x" * 22
    refused = stranger.delete(f"/v1/batches/{batch_id}")
    absent = stranger.delete(f"/v1/batches/{missing}")
    assert refused.status_code == absent.status_code == 404
    assert refused.json() == json.loads(absent.text.replace(missing, batch_id))
    assert owner_client.get(f"/v1/batches/{batch_id}").json()["status"] == "queued"

    cancelled = admin.delete(f"/v1/batches/{batch_id}")
    assert cancelled.status_code == 200, cancelled.text
    assert cancelled.json()["status"] == "cancelled"
    assert owner_client.get(f"/v1/batches/{batch_id}").json()["status"] == "cancelled"

    with registry.session() as session:
        admin_key = tenants.lookup_key(session, seeded.admin_key)
    assert admin_key is not None
    entries = admin.get(f"/v1/models/{model}/audit").json()["entries"]
    [cancel] = [e for e in entries if e["action"] == "batch.cancel"]
    assert cancel["actor"] == f"key:{admin_key.key_id}"
    assert cancel["before"] == {"batch": batch_id, "tenant": owner, "status": "queued"}
    assert cancel["after"] == {"batch": batch_id, "tenant": owner, "status": "cancelled"}
    admin.delete(f"/v1/schedules/{created['id']}")
    actions = [e["action"] for e in admin.get(f"/v1/models/{model}/audit").json()["entries"]]
    assert actions[:3] == ["schedule.delete", "batch.cancel", "schedule.create"]
