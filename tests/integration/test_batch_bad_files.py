"""Bad batch inputs through the API and the real feeder: a file the reader cannot go on with fails
its batch with the row and the reason, a bad row fails alone, a line longer than the bound is never
held whole, and a cancel is taken at any stage, counting included."""

from __future__ import annotations

import csv
import io
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis as redis_sync

from sluice.registry.store import Registry
from sluice.registry.tables import Batch
from sluice.settings import Settings
from sluice.wire import keys
from workers.batches import BatchFeeder, job_id

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("batches_ended_after")]

MiB = 1 << 20


@pytest.fixture
def synth(register_synthetic: Callable[..., str], start_worker: Callable[..., Any]) -> str:
    model = register_synthetic("badfiles")
    start_worker(model)
    return model


def _upload(client: httpx.Client, model: str, name: str, content: Any, **fields: str) -> dict[str, Any]:
    response = client.post("/v1/batches", data={"model": model, **fields},
                           files={"file": (name, content, "application/octet-stream")})
    assert response.status_code == 202, response.text
    body: dict[str, Any] = response.json()
    return body


def _rows(client: httpx.Client, batch_id: str) -> list[dict[str, Any]]:
    body = client.get(f"/v1/batches/{batch_id}/output").content
    return [json.loads(line) for line in body.splitlines() if line.strip()]


def _peak_rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM in /proc/self/status")


def test_a_jsonl_line_longer_than_the_bound_fails_the_batch_without_being_held(
    demo: httpx.Client, synth: str, feeder: Callable[..., BatchFeeder], tmp_path: Path
) -> None:
    # Two good rows, then 128 MiB with no newline (sparse: it costs no disk to write).
    source = tmp_path / "no-newline.jsonl"
    with source.open("wb") as handle:
        handle.write(b'{"text": "a"}\n\n{"text": "b"}\n{"text": "')
        handle.truncate(128 * MiB)
    with source.open("rb") as handle:
        batch = _upload(demo, synth, "in.jsonl", handle)

    before = _peak_rss_kib()
    assert feeder().run(batch["id"]) == "failed"
    grown_mib = (_peak_rss_kib() - before) / 1024

    final = demo.get(f"/v1/batches/{batch['id']}").json()
    assert final["status"] == "failed" and final["finished_at"]
    assert final["error"] == f"row 2: line longer than {MiB} bytes"
    assert grown_mib < 48, f"reading the file grew the peak RSS by {grown_mib:.0f} MiB"


def test_an_inline_input_longer_than_the_bound_is_refused_at_submit(
    demo: httpx.Client, synth: str, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The suite's bodies are smaller than the default bound: the bound is lowered under them.
    monkeypatch.setattr(settings, "batch_max_line_bytes", 4096)
    response = demo.post("/v1/batches", json={"model": synth, "inputs": [{"text": "ok"}, {"text": "x" * 5000}]})
    assert response.status_code == 413, response.text
    assert response.json()["error"]["message"].startswith("input 1 is longer than 4096 bytes")


def test_a_csv_field_of_200000_characters_fails_its_row_and_the_batch_goes_on(
    demo: httpx.Client, synth: str, feeder: Callable[..., BatchFeeder], settings: Settings
) -> None:
    text = io.StringIO()
    writer = csv.writer(text)
    writer.writerow(["id", "text"])
    writer.writerows([[0, "fine"], [1, "x" * 200_000], [2, "fine too"]])
    batch = _upload(demo, synth, "in.csv", text.getvalue().encode())

    assert feeder().run(batch["id"]) == "succeeded"
    final = demo.get(f"/v1/batches/{batch['id']}").json()
    assert (final["status"], final["total"], final["done"], final["failed"]) == ("succeeded", 3, 2, 1)
    rows = _rows(demo, batch["id"])
    assert [row["status"] for row in rows] == ["succeeded", "failed", "succeeded"]
    assert rows[1]["error"]["message"] == f"input.text has 200000 characters; the limit is {settings.max_text_chars}"


def test_a_csv_record_longer_than_the_bound_fails_the_batch_with_its_row(
    demo: httpx.Client, synth: str, feeder: Callable[..., BatchFeeder]
) -> None:
    # A quote left open at row 3 makes the rest of the file one field.
    lines = ["text", "a", "b", "c", '"open', *(["y" * 1000] * 1500)]
    batch = _upload(demo, synth, "in.csv", ("\n".join(lines) + "\n").encode())

    assert feeder().run(batch["id"]) == "failed"
    final = demo.get(f"/v1/batches/{batch['id']}").json()
    assert final["status"] == "failed" and final["finished_at"]
    assert final["error"].startswith(f"row 3: record longer than {MiB} bytes")


def test_rows_that_are_not_json_or_lack_the_field_fail_alone(
    demo: httpx.Client, synth: str, feeder: Callable[..., BatchFeeder]
) -> None:
    content = b'{"text": "one"}\n{not json\n{"body": "no text"}\n{"text": "four"}\n'
    batch = _upload(demo, synth, "in.jsonl", content)

    assert feeder().run(batch["id"]) == "succeeded"
    rows = _rows(demo, batch["id"])
    assert [row["status"] for row in rows] == ["succeeded", "failed", "failed", "succeeded"]
    assert rows[1]["error"]["message"].startswith("not JSON")
    assert rows[2]["error"]["message"] == "the row has no field 'text'"


def test_a_corrupt_parquet_row_group_fails_the_batch_at_its_first_row(
    demo: httpx.Client, synth: str, feeder: Callable[..., BatchFeeder], rds: redis_sync.Redis,
) -> None:
    sink = io.BytesIO()
    pq.write_table(pa.table({"text": [f"parquet row {i}" for i in range(1000)]}), sink, row_group_size=100)
    data = bytearray(sink.getvalue())
    group = pq.ParquetFile(io.BytesIO(bytes(data))).metadata.row_group(4).column(0)
    start = group.data_page_offset
    data[start + 20:start + 200] = b"\xab" * 180
    batch = _upload(demo, synth, "in.parquet", bytes(data))

    assert feeder(max_in_flight=32).run(batch["id"]) == "failed"
    final = demo.get(f"/v1/batches/{batch['id']}").json()
    assert final["status"] == "failed" and final["finished_at"]
    assert final["error"].startswith("row 400: the Parquet file cannot be read from here on")
    assert final["total"] == 1000
    rows = _rows(demo, batch["id"])
    assert [row["row"] for row in rows] == list(range(len(rows)))
    assert len(rows) <= 400 and all(row["status"] in ("succeeded", "cancelled") for row in rows)
    # The rows it had queued do not run on after the batch has failed.
    queued = [keys.job(job_id(batch["id"], row, model=synth, version="v1")) for row in range(len(rows), 400)]
    assert not any(rds.hget(key, "status") == "queued" for key in queued)


def test_a_cancel_while_rows_are_counted_ends_the_batch(
    demo: httpx.Client, synth: str, feeder: Callable[..., BatchFeeder], settings: Settings
) -> None:
    batch = _upload(demo, synth, "in.jsonl", b'{"text": "first"}\n')
    # Grown on disk to what takes minutes to count (200 million lines), as a big upload would be.
    with (settings.batch_storage / batch["id"] / "input.jsonl").open("ab") as handle:
        for _ in range(100):
            handle.write(b"\n" * (2 * MiB))
        handle.write(b'{"text": "last"}\n')

    outcome: list[str] = []
    thread = threading.Thread(target=lambda: outcome.append(feeder().run(batch["id"])))
    thread.start()
    deadline = time.monotonic() + 30
    while demo.get(f"/v1/batches/{batch['id']}").json()["status"] != "running":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.5)
    cancelled_at = time.monotonic()
    assert demo.delete(f"/v1/batches/{batch['id']}").json()["status"] == "cancelled"
    thread.join(timeout=60)
    assert outcome == ["cancelled"]
    assert time.monotonic() - cancelled_at < 5, "the feeder counted on after the cancel"
    final = demo.get(f"/v1/batches/{batch['id']}").json()
    assert final["status"] == "cancelled" and final["finished_at"] and final["total"] is None


def test_a_bad_file_s_batch_cannot_hold_a_running_place(
    demo: httpx.Client, synth: str, feeder: Callable[..., BatchFeeder], registry: Registry
) -> None:
    # A batch whose file stops the reader ends; it is not left running for the next sweep to retry.
    batch = _upload(demo, synth, "in.jsonl", b'{"text": "' + b"z" * (2 * MiB) + b'"}\n')
    assert feeder().run(batch["id"]) == "failed"
    with registry.session() as session:
        row = session.get(Batch, batch["id"])
        assert row is not None
        assert (row.status, row.lease_owner, row.finished_at is not None) == ("failed", None, True)
    assert feeder().run(batch["id"]) == "skipped"
