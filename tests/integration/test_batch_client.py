"""Batch scoring as users drive it: the Python client and `sluice batch`, with batches fed the way
Celery feeds them (every batch that needs a feeder gets one)."""

from __future__ import annotations

import csv
import json
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from launch.cli import app
from launch.seed import Seeded
from sluice.registry.batches import to_dispatch
from sluice_client import AsyncClient, NotFoundError, SluiceClient
from tests.support import ApiServer
from workers.batches import BatchFeeder

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("batches_ended_after")]


@pytest.fixture
def feeding(feeder: Callable[..., BatchFeeder]) -> Iterator[None]:
    """What beat's sweep and the Celery workers do: a feeder for each batch that needs one."""
    run = feeder(lease_s=10.0)
    stop = threading.Event()
    runs: list[threading.Thread] = []

    def sweep() -> None:
        while not stop.wait(0.2):
            with run.registry.session() as session:
                waiting = to_dispatch(session, now=datetime.now(UTC), lease_s=run.lease_s)
            for batch_id in waiting:
                runs.append(threading.Thread(target=run.run, args=(batch_id,), daemon=True))
                runs[-1].start()

    sweeper = threading.Thread(target=sweep, daemon=True)
    sweeper.start()
    yield
    stop.set()
    run.request_stop()
    sweeper.join()
    for thread in runs:
        thread.join(timeout=10)


@pytest.fixture
def model(register_synthetic: Callable[..., str], start_worker: Callable[..., Any]) -> str:
    name = register_synthetic("clientbatch")
    start_worker(name)
    return name


def test_the_client_submits_a_file_follows_it_and_downloads_the_output(
    api: ApiServer, seeded: Seeded, model: str, feeding: None, tmp_path: Path
) -> None:
    source = tmp_path / "in.csv"
    with source.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["text"])
        writer.writerows([f"line {i}"] for i in range(250))
    with SluiceClient(base_url=api.url, api_key=seeded.demo_key) as client:
        batch = client.submit_batch(model, file=source, output_format="csv")
        seen = [progress["done"] for progress in client.follow_batch(batch["id"], poll_s=0.2, timeout_s=60)]
        assert seen == sorted(seen) and seen[-1] == 250
        assert client.batch(batch["id"])["status"] == "succeeded"
        assert batch["id"] in {b["id"] for b in client.batches()}
        target = client.download_batch(batch["id"], tmp_path / "out.csv")
        with target.open() as handle:
            rows = list(csv.DictReader(handle))
        assert [int(row["row"]) for row in rows] == list(range(250))
        inline = client.submit_batch(model, inputs=[{"text": "a"}, {"text": "b"}])
        assert client.wait_batch(inline["id"], timeout_s=60)["done"] == 2
        with pytest.raises(NotFoundError):
            client.batch("bat_nope")
        with pytest.raises(ValueError, match="exactly one"):
            client.submit_batch(model, inputs=[{"text": "a"}], input_uri="file:///x")


async def test_the_async_client_follows_a_batch(api: ApiServer, seeded: Seeded, model: str, feeding: None) -> None:
    async with AsyncClient(base_url=api.url, api_key=seeded.demo_key) as client:
        batch = await client.submit_batch(model, inputs=[{"text": f"t{i}"} for i in range(40)])
        seen = [progress async for progress in client.follow_batch(batch["id"], poll_s=0.2, timeout_s=60)]
        assert (seen[-1]["status"], seen[-1]["done"]) == ("succeeded", 40)


def test_sluice_batch_submit_follow_download_as_printed(
    api: ApiServer, seeded: Seeded, model: str, feeding: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "calls.jsonl"
    source.write_text("".join(json.dumps({"text": f"call {i}"}) + "\n" for i in range(120)))
    monkeypatch.setenv("SLUICE_URL", api.url)
    monkeypatch.setenv("SLUICE_API_KEY", seeded.demo_key)
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()

    submitted = runner.invoke(app, ["batch", "submit", str(source), "--model", model, "--follow"])
    assert submitted.exit_code == 0, submitted.output
    assert "succeeded, 120 done, 0 failed of 120" in submitted.output
    assert "rows/s" in submitted.output and "120/120" in submitted.output
    batch_id = submitted.output.split()[1]

    status = runner.invoke(app, ["batch", "status", batch_id, "--json"])
    assert status.exit_code == 0 and json.loads(status.output)["done"] == 120
    downloaded = runner.invoke(app, ["batch", "download", batch_id, "--format", "parquet"])
    assert downloaded.exit_code == 0, downloaded.output
    import pyarrow.parquet as pq

    assert pq.read_table(tmp_path / f"{batch_id}.parquet").column("row").to_pylist() == list(range(120))
    listed = runner.invoke(app, ["batch", "list"])
    assert batch_id in listed.output

    missing = runner.invoke(app, ["batch", "status", "bat_missing"])
    assert missing.exit_code == 1 and "does not exist" in missing.output
    assert runner.invoke(app, ["batch", "cancel", batch_id]).exit_code == 1
