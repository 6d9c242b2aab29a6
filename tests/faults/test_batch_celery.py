"""Batch scoring on real Celery processes: a worker SIGKILLed in the middle of a batch loses and
duplicates no row, and two beat processes dispatch each schedule slot once."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from croniter import croniter

from sluice.settings import Settings
from tests.support import REPO, stop_process, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("batches_ended_after"), pytest.mark.soak]

# Each batch of 32 takes about 0.07 s: a few thousand rows last long enough to kill a feeder.
STEADY_SYNTHETIC = "fixed_s=0.005&per_item_s=0.002&per_token_s=0"


@pytest.fixture
def celery(redis_url: str, database_url: str, settings: Settings,
           tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Start `celery -A workers.tasks` processes (worker or beat) with a fast sweep and a short lease."""
    started: list[subprocess.Popen[bytes]] = []
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    env.update({
        "SLUICE_REDIS_URL": redis_url, "SLUICE_DATABASE_URL": database_url, "SLUICE_HOME": str(settings.home),
        "SLUICE_BATCH_ROOT": str(settings.batch_root), "SLUICE_BATCH_SWEEP_S": "0.5", "SLUICE_BATCH_LEASE_S": "3",
        "SLUICE_BATCH_CHECKPOINT_S": "0.2", "SLUICE_BATCH_MAX_IN_FLIGHT": "128", "PYTHONUNBUFFERED": "1",
    })

    def start(*args: str) -> subprocess.Popen[bytes]:
        log = tmp_path / f"celery-{len(started)}.log"
        with log.open("wb") as sink:
            # A session of its own: killing the group takes the embedded beat child with the worker,
            # as a host or container dying would.
            proc = subprocess.Popen([sys.executable, "-m", "celery", "-A", "workers.tasks", *args], cwd=REPO, env=env,
                                    stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        stop_process(proc, signal.SIGTERM, timeout_s=20)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def _worker(celery: Callable[..., subprocess.Popen[bytes]], *, beat: bool) -> subprocess.Popen[bytes]:
    return celery("worker", *(["--beat", "--schedule", f"/tmp/beat-{secrets.token_hex(4)}"] if beat else []),
                  "--pool", "threads", "--concurrency", "4", "--hostname", f"batch-{secrets.token_hex(3)}@%h",
                  "--without-mingle", "--without-gossip", "--loglevel", "INFO")


def _batch(client: httpx.Client, batch_id: str) -> dict[str, Any]:
    response = client.get(f"/v1/batches/{batch_id}")
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def test_a_celery_worker_killed_mid_batch_loses_and_duplicates_no_row(
    demo: httpx.Client, register_synthetic: Callable[..., str], start_worker: Callable[..., Any],
    celery: Callable[..., subprocess.Popen[bytes]],
) -> None:
    model = register_synthetic("killbatch", cost=STEADY_SYNTHETIC)
    start_worker(model)
    rows = 3000
    lines = "".join(json.dumps({"text": f"row {i} " + "word " * (i % 7)}) + "\n" for i in range(rows))
    response = demo.post("/v1/batches", data={"model": model},
                         files={"file": ("in.jsonl", lines.encode(), "application/x-ndjson")})
    assert response.status_code == 202, response.text
    batch_id = response.json()["id"]

    first = _worker(celery, beat=True)
    wait_until(lambda: _batch(demo, batch_id)["done"] >= 600, timeout_s=90, what="600 rows done")
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=10)
    killed_at = _batch(demo, batch_id)
    assert killed_at["status"] == "running" and killed_at["done"] < rows

    _worker(celery, beat=True)
    wait_until(lambda: _batch(demo, batch_id)["status"] == "succeeded", timeout_s=120, what="the batch to finish")
    final = _batch(demo, batch_id)
    assert (final["total"], final["done"], final["failed"]) == (rows, rows, 0)
    output = [json.loads(line) for line in demo.get(f"/v1/batches/{batch_id}/output").content.splitlines()]
    assert [row["row"] for row in output] == list(range(rows))
    assert all(row["status"] == "succeeded" for row in output)


def test_two_beat_processes_dispatch_each_schedule_slot_once(
    admin: httpx.Client, settings: Settings, register_synthetic: Callable[..., str],
    start_worker: Callable[..., Any], celery: Callable[..., subprocess.Popen[bytes]],
) -> None:
    assert settings.batch_root is not None
    model = register_synthetic("twobeats")
    start_worker(model)
    folder = settings.batch_root / "tenants" / "admin" / model
    folder.mkdir(parents=True, exist_ok=True)
    for day in (datetime.now(UTC) - timedelta(days=1), datetime.now(UTC), datetime.now(UTC) + timedelta(days=1)):
        (folder / f"{day:%Y-%m-%d}.jsonl").write_text('{"text": "nightly"}\n')
    _worker(celery, beat=False)
    for _ in range(2):
        celery("beat", "--schedule", f"/tmp/beat-{secrets.token_hex(4)}", "--loglevel", "INFO")
    cron = "* * * * * */2"  # every two seconds: croniter's sixth field is the second
    response = admin.post("/v1/schedules", json={
        "model": model, "cron": cron, "timezone": "UTC",
        "input_uri": f"{model}/{{date}}.jsonl"})
    assert response.status_code == 201, response.text
    schedule = response.json()
    created = datetime.now(UTC)
    time.sleep(7.5)
    stopped = datetime.now(UTC)
    assert admin.delete(f"/v1/schedules/{schedule['id']}").status_code == 200

    slots = croniter(cron, created - timedelta(seconds=2))
    possible = []
    while (slot := slots.get_next(datetime)) <= stopped:
        possible.append(slot)
    # Every slot a sweep has certainly looked at since (sweeps every 0.5 s) has run; none twice.
    certain = [slot for slot in possible if slot >= created and slot <= stopped - timedelta(seconds=1.5)]
    assert len(certain) >= 3

    def runs() -> list[dict[str, Any]]:
        listed: list[dict[str, Any]] = admin.get("/v1/batches", params={"schedule_id": schedule["id"]}
                                                 ).json()["batches"]
        return listed

    ran = sorted(run["slot"] for run in runs())
    assert len(ran) == len(set(ran)), ran
    iso = [slot.isoformat().replace("+00:00", "Z") for slot in certain]
    assert set(iso) <= set(ran), (iso, ran)
    assert set(ran) <= {slot.isoformat().replace("+00:00", "Z") for slot in possible}
    wait_until(lambda: {run["status"] for run in runs()} == {"succeeded"}, timeout_s=60, what="every run finished")
