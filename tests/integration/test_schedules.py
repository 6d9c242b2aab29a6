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

from sluice.registry import batches as queries
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
    for slot in slots[:5]:
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
