"""Batch scoring through the API with a real worker and the real feeder: inline inputs, uploads
and `input_uri`s in three formats, outputs in input order with per-row errors, cancel, the
feeder's lease and a takeover that writes every row once."""

from __future__ import annotations

import csv
import io
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis as redis_sync

from sluice.registry import batches as queries
from sluice.registry.store import Registry
from sluice.settings import Settings
from sluice.wire import keys
from sluice.wire.connections import connect_sync
from workers.batches import BatchFeeder, job_id

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("batches_ended_after")]


@pytest.fixture
def synth(register_synthetic: Callable[..., str], start_worker: Callable[..., Any]) -> str:
    model = register_synthetic("batch")
    start_worker(model)
    return model


def _rows(body: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in body.splitlines() if line.strip()]


def _create(client: httpx.Client, **body: Any) -> dict[str, Any]:
    response = client.post("/v1/batches", json=body)
    assert response.status_code == 202, response.text
    assert response.headers["Location"] == f"/v1/batches/{response.json()['id']}"
    return response.json()


def test_inline_inputs_come_back_in_input_order_with_per_row_errors(
    demo: httpx.Client, synth: str, feeder: Callable[..., BatchFeeder]
) -> None:
    inputs: list[Any] = [{"text": f"row {i}"} for i in range(300)]
    inputs[7] = {"nope": 1}
    inputs[150] = "not an object"
    batch = _create(demo, model=synth, inputs=inputs, metadata={"team": "search"})
    assert batch["status"] == "queued" and batch["total"] == 300 and batch["metadata"] == {"team": "search"}

    assert feeder().run(batch["id"]) == "succeeded"

    done = demo.get(f"/v1/batches/{batch['id']}").json()
    assert (done["status"], done["total"], done["done"], done["failed"]) == ("succeeded", 300, 298, 2)
    assert done["started_at"] and done["finished_at"]
    # Absent, not null, when there is none: as the job resource.
    assert not {"error", "schedule_id", "slot"} & done.keys()
    rows = _rows(demo.get(f"/v1/batches/{batch['id']}/output").content)
    assert [row["row"] for row in rows] == list(range(300))
    assert rows[7]["status"] == "failed" and rows[7]["error"]["code"] == "invalid_input"
    assert rows[150]["status"] == "failed"
    assert rows[0]["status"] == "succeeded" and "output" in rows[0]
    assert all(row["status"] == "succeeded" for i, row in enumerate(rows) if i not in (7, 150))


def test_csv_and_parquet_uploads_and_every_output_format(
    demo: httpx.Client, synth: str, feeder: Callable[..., BatchFeeder]
) -> None:
    text = io.StringIO()
    writer = csv.writer(text)
    writer.writerow(["id", "body"])
    for i in range(120):
        writer.writerow([i, f"line {i}, with a comma\nand a newline"])
    response = demo.post("/v1/batches", data={"model": synth, "text_field": "body"},
                         files={"file": ("in.csv", text.getvalue().encode(), "text/csv")})
    assert response.status_code == 202, response.text
    from_csv = response.json()

    table = pa.table({"text": [f"p {i}" for i in range(90)], "other": list(range(90))})
    sink = io.BytesIO()
    pq.write_table(table, sink, row_group_size=25)
    response = demo.post("/v1/batches", data={"model": synth, "output_format": "parquet"},
                         files={"file": ("in.parquet", sink.getvalue(), "application/octet-stream")})
    assert response.status_code == 202, response.text
    from_parquet = response.json()
    assert from_parquet["output"]["format"] == "parquet"

    run = feeder()
    assert run.run(from_csv["id"]) == "succeeded"
    assert run.run(from_parquet["id"]) == "succeeded"

    as_csv = demo.get(f"/v1/batches/{from_csv['id']}/output", params={"format": "csv"})
    assert as_csv.headers["content-type"].startswith("text/csv")
    records = list(csv.DictReader(io.StringIO(as_csv.text)))
    assert [int(r["row"]) for r in records] == list(range(120))
    assert all(r["status"] == "succeeded" and json.loads(r["output"]) for r in records)

    as_parquet = demo.get(f"/v1/batches/{from_parquet['id']}/output")
    read = pq.read_table(io.BytesIO(as_parquet.content))
    assert read.column("row").to_pylist() == list(range(90))
    assert set(read.column("status").to_pylist()) == {"succeeded"}
    jsonl = _rows(demo.get(f"/v1/batches/{from_parquet['id']}/output", params={"format": "jsonl"}).content)
    assert [row["row"] for row in jsonl] == list(range(90))


def test_an_input_uri_must_name_a_file_in_the_tenants_folder(
    demo: httpx.Client, settings: Settings, synth: str, tmp_path: Path
) -> None:
    assert settings.batch_root is not None
    folder = settings.batch_root / "tenants" / "demo"
    folder.mkdir(parents=True, exist_ok=True)
    inside = folder / f"{synth}.jsonl"
    inside.write_text("".join(json.dumps({"text": f"t{i}"}) + "\n" for i in range(5)))
    assert _create(demo, model=synth, input_uri=inside.as_uri())["status"] == "queued"
    assert _create(demo, model=synth, input_uri=inside.name)["status"] == "queued"

    outside = tmp_path / "secret.jsonl"
    outside.write_text('{"text": "x"}\n')
    (settings.batch_root / outside.name).write_text('{"text": "x"}\n')
    for uri in (outside.as_uri(), f"{settings.batch_root.as_uri()}/{outside.name}", f"../../{outside.name}",
                "http://example.com/a.jsonl", (folder / "missing.jsonl").as_uri()):
        response = demo.post("/v1/batches", json={"model": synth, "input_uri": uri})
        assert response.status_code == 422, (uri, response.text)
        assert response.json()["error"]["code"] == "invalid_input"


@pytest.mark.parametrize(("body", "status"), [
    ({"model": "m"}, 422),
    ({"model": "m", "inputs": [{"text": "a"}], "input_uri": "file:///x.jsonl"}, 422),
    ({"model": "m", "inputs": []}, 422),
    ({"model": "m", "inputs": [{"text": "a"}], "output_format": "xlsx"}, 422),
    ({"model": "m", "inputs": [{"text": "a"}], "surprise": 1}, 422),
    ({"model": "no-such-model", "inputs": [{"text": "a"}]}, 404),
])
def test_bad_batch_requests_get_a_clear_error(demo: httpx.Client, synth: str, body: dict[str, Any],
                                              status: int) -> None:
    if body["model"] == "m":
        body = {**body, "model": synth}
    response = demo.post("/v1/batches", json=body)
    assert response.status_code == status, response.text
    assert "error" in response.json()


def test_uploads_are_checked_before_the_batch_is_accepted(demo: httpx.Client, synth: str) -> None:
    no_column = demo.post("/v1/batches", data={"model": synth},
                          files={"file": ("in.csv", b"id,body\n1,hello\n", "text/csv")})
    assert no_column.status_code == 422 and "no column 'text'" in no_column.json()["error"]["message"]
    unknown_suffix = demo.post("/v1/batches", data={"model": synth}, files={"file": ("in.xlsx", b"x", "x/y")})
    assert unknown_suffix.status_code == 422
    not_parquet = demo.post("/v1/batches", data={"model": synth},
                            files={"file": ("in.parquet", b"not parquet", "x/y")})
    assert not_parquet.status_code == 422
    no_file = demo.post("/v1/batches", data={"model": synth}, files={"other": ("a.csv", b"text\na\n", "text/csv")})
    assert no_file.status_code == 422
    plain = demo.post("/v1/batches", content=b"text", headers={"Content-Type": "text/plain"})
    assert plain.status_code == 422


def test_a_batch_is_its_tenant_s(demo: httpx.Client, new_tenant: Callable[..., tuple[str, httpx.Client]],
                                 synth: str) -> None:
    batch = _create(demo, model=synth, inputs=[{"text": "mine"}])
    _, other = new_tenant("other")
    for method, path in (("GET", ""), ("GET", "/output"), ("DELETE", "")):
        response = other.request(method, f"/v1/batches/{batch['id']}{path}")
        assert response.status_code == 404, (method, path, response.text)
    assert batch["id"] not in {b["id"] for b in other.get("/v1/batches").json()["batches"]}
    assert batch["id"] in {b["id"] for b in demo.get("/v1/batches").json()["batches"]}


def test_cancelling_a_queued_batch_ends_it_and_its_feeder_skips_it(
    demo: httpx.Client, synth: str, feeder: Callable[..., BatchFeeder]
) -> None:
    batch = _create(demo, model=synth, inputs=[{"text": "never"}] * 10)
    cancelled = demo.delete(f"/v1/batches/{batch['id']}")
    assert cancelled.status_code == 200
    assert cancelled.json()["status"] == "cancelled" and cancelled.json()["finished_at"]
    assert demo.delete(f"/v1/batches/{batch['id']}").status_code == 409
    assert feeder().run(batch["id"]) == "skipped"


def test_a_cancelled_inline_batch_keeps_the_total_given_at_submit(
    demo: httpx.Client, synth: str, feeder: Callable[..., BatchFeeder]
) -> None:
    batch = _create(demo, model=synth, inputs=[{"text": f"r{i}"} for i in range(1000)])
    assert batch["total"] == 1000
    cancelled = demo.delete(f"/v1/batches/{batch['id']}").json()
    assert (cancelled["status"], cancelled["total"]) == ("cancelled", 1000)
    assert feeder().run(batch["id"]) == "skipped"
    assert demo.get(f"/v1/batches/{batch['id']}").json()["total"] == 1000
    assert batch["id"] in {b["id"] for b in demo.get("/v1/batches").json()["batches"] if b["total"] == 1000}


def test_cancelling_a_running_batch_stops_its_feeding(
    demo: httpx.Client, register_synthetic: Callable[..., str], start_worker: Callable[..., Any],
    feeder: Callable[..., BatchFeeder],
) -> None:
    model = register_synthetic("slowbatch", cost="fixed_s=0.04&per_item_s=0.001&per_token_s=0")
    start_worker(model)
    batch = _create(demo, model=model, inputs=[{"text": f"r{i}"} for i in range(2000)])
    outcome: list[str] = []
    thread = threading.Thread(target=lambda: outcome.append(feeder(max_in_flight=32).run(batch["id"])))
    thread.start()
    _wait_for(lambda: demo.get(f"/v1/batches/{batch['id']}").json()["done"] > 0)
    assert demo.delete(f"/v1/batches/{batch['id']}").json()["status"] == "cancelled"
    thread.join(timeout=60)
    assert outcome == ["cancelled"]
    final = demo.get(f"/v1/batches/{batch['id']}").json()
    assert final["status"] == "cancelled" and final["finished_at"] and final["total"] == 2000
    rows = _rows(demo.get(f"/v1/batches/{batch['id']}/output").content)
    assert [row["row"] for row in rows] == list(range(len(rows)))
    assert len(rows) < 2000 and final["done"] + final["failed"] <= len(rows)


def test_a_second_feeder_finds_the_lease_held(
    demo: httpx.Client, synth: str, feeder: Callable[..., BatchFeeder], registry: Registry
) -> None:
    batch = _create(demo, model=synth, inputs=[{"text": "x"}])
    with registry.session() as session:
        from datetime import UTC, datetime
        assert queries.claim(session, batch["id"], owner="someone-else", now=datetime.now(UTC), lease_s=60,
                             max_running=8) is not None
    assert feeder().run(batch["id"]) == "skipped"


def test_a_feeder_that_takes_over_writes_every_row_exactly_once(
    demo: httpx.Client, synth: str, feeder: Callable[..., BatchFeeder], settings: Settings,
    rds: redis_sync.Redis,
) -> None:
    batch = _create(demo, model=synth, inputs=[{"text": f"row {i}"} for i in range(400)])
    first = feeder(lease_s=2.0, max_in_flight=32)
    outcome: list[str] = []
    thread = threading.Thread(target=lambda: outcome.append(first.run(batch["id"])))
    thread.start()
    _wait_for(lambda: demo.get(f"/v1/batches/{batch['id']}").json()["done"] >= 100)
    first.request_stop()
    thread.join(timeout=30)
    assert outcome == ["stopped"]
    # What a feeder killed between checkpoints leaves: a torn line past the checkpoint, and jobs
    # of the rows after it already queued.
    output = settings.batch_storage / batch["id"] / "output.jsonl"
    with output.open("ab") as handle:
        handle.write(b'{"row": 99999, "status": "succ')
    progress = demo.get(f"/v1/batches/{batch['id']}").json()
    last = keys.job(job_id(batch["id"], progress["done"], model=synth, version="v1"))
    assert rds.exists(last) or progress["done"] < 400

    assert feeder().run(batch["id"]) == "succeeded"
    rows = _rows(demo.get(f"/v1/batches/{batch['id']}/output").content)
    assert [row["row"] for row in rows] == list(range(400))
    assert all(row["status"] == "succeeded" for row in rows)
    assert demo.get(f"/v1/batches/{batch['id']}").json()["done"] == 400
    # Written lines' jobs are deleted: a million-row batch holds only its window in Redis.
    assert not rds.exists(keys.job(job_id(batch["id"], 0, model=synth, version="v1")))


def _wait_for(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


def test_a_finished_batch_s_callback_is_queued_once_and_posts_the_signed_batch(
    demo: httpx.Client, synth: str, feeder: Callable[..., BatchFeeder], registry: Registry,
    rds: redis_sync.Redis, settings: Settings,
) -> None:
    import random

    from sluice import webhooks
    from sluice.registry import tenants
    from sluice.registry.tables import Batch
    from tests.support import receiving
    from workers.batches import callback_delivery_id
    from workers.delivery import Deliverer, TenantLimits

    batch = _create(demo, model=synth, inputs=[{"text": "a"}, {"text": "b"}])
    with receiving() as receiver:
        with registry.session() as session:
            row = session.get(Batch, batch["id"])
            assert row is not None
            # Set here: the suite's API refuses loopback callbacks, as it should.
            row.callback_url = receiver.plan("/batch", 200)
        run = feeder()
        assert run.run(batch["id"]) == "succeeded"
        assert run.send_callbacks() == 0  # queued by the finish already, and only then
        delivery_id = callback_delivery_id(batch["id"])
        entries = [fields for _, fields in rds.xrange(keys.WEBHOOK_OUTBOX) if fields.get("job") == batch["id"]]
        assert entries == [{"delivery": delivery_id, "job": batch["id"]}]
        deliverer = Deliverer(redis=connect_sync(settings.require_redis_url()), registry=registry,
                              http=httpx.Client(timeout=5.0), allowed=webhooks.allowed_networks(["127.0.0.0/8"]),
                              max_attempts=3, backoff_base_s=1, backoff_cap_s=1, attempt_deadline_s=25.0,
                              tenant_limits=TenantLimits(in_flight=8, rate_per_s=100.0, burst=100), ttl_s=600,
                              rng=random.Random(1))
        try:
            assert deliverer.attempt(delivery_id, batch["id"]).outcome == "delivered"
            assert deliverer.attempt(delivery_id, batch["id"]).outcome == "skipped"
        finally:
            deliverer.http.close()
            deliverer.redis.close()
            rds.zrem(keys.WEBHOOK_DUE, delivery_id)
        [request] = receiver.received("/batch")
    body = json.loads(request.body)
    assert (body["id"], body["status"], body["done"]) == (batch["id"], "succeeded", 2)
    with registry.session() as session:
        secret = tenants.tenant_secret(session, "demo")
    assert secret and webhooks.verify(secret, request.headers["sluice-signature"], request.body)
