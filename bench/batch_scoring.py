"""Batch scoring beside online traffic: does the bulk lane yield?

One platform (API, MiniLM workers, a Celery worker with beat, as real processes). The same
open-loop online load (Poisson arrivals on a timetable fixed in advance, one job per request)
runs twice: alone, then while a 20,000-row JSONL batch and a 5,000-row Parquet batch are fed on
the version's bulk lane. Reported: the online jobs' queue wait (enqueued -> started) and total
latency percentiles in both phases, the batches' throughput, and a check of their outputs
(every row once, in input order, the seeded bad rows failed alone).

Run: ``python -m bench.batch_scoring [--workers 2] [--rate 10] [--duration 40]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from bench.load import open_loop, poisson_timetable
from bench.machine import machine_info
from bench.output import PERCENTILE_METHOD, command_line, table, write_json
from bench.platform import read_jobs, wait_done
from bench.platform_harness import BenchPlatform
from bench.processes import sigterm_as_interrupt, stop_processes
from scheduler.planning.text_mix import skewed_texts
from sluice.stats import percentiles

MODEL, VERSION = "minilm", "v1"
# Every this-many-th JSONL row is not a valid input: it must fail alone, with its row number.
BAD_EVERY = 997


def start_celery(platform: BenchPlatform, batch_root: Path) -> subprocess.Popen[bytes]:
    env = dict(platform._env(), SLUICE_BATCH_ROOT=str(batch_root), SLUICE_BATCH_SWEEP_S="1")
    with (platform.home / "logs" / "celery.log").open("ab") as sink:
        return subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "workers.tasks", "worker", "--beat", "--pool", "threads",
             "--hostname", "bench@%h", "--without-mingle", "--without-gossip", "--loglevel", "INFO",
             "--schedule", str(platform.home / "beat-schedule")],
            env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)


async def _fire(platform: BenchPlatform, texts: Sequence[str], offsets: Sequence[float]) -> list[Any]:
    headers = {"Authorization": f"Bearer {platform.demo_key}"}
    async with httpx.AsyncClient(base_url=platform.api_url, headers=headers, timeout=60,
                                 limits=httpx.Limits(max_connections=64)) as client:

        async def send(i: int) -> str:
            response = await client.post(f"/v1/models/{MODEL}/jobs", json={"input": {"text": texts[i]}})
            if response.status_code != 202:
                raise RuntimeError(f"{response.status_code}: {response.text[:200]}")
            return str(response.json()["id"])

        return await open_loop(offsets, send)


def online_phase(platform: BenchPlatform, *, rate: float, duration_s: float, seed: int) -> dict[str, Any]:
    n = max(1, int(rate * duration_s))
    texts = skewed_texts(n, seed=seed)
    sent = asyncio.run(_fire(platform, texts, poisson_timetable(rate, n, seed=seed)))
    ids = [record.result for record in sent if record.error is None]
    wait_done(platform, ids, timeout_s=300)
    jobs = read_jobs(platform, ids)
    scheduled = {record.result: record.scheduled_at for record in sent if record.error is None}
    waits = [(job["started_at"] - job["enqueued_at"]) * 1000 for job in jobs if job["status"] == "succeeded"]
    totals = [(job["finished_at"] - scheduled[job["id"]]) * 1000 for job in jobs if job["status"] == "succeeded"]
    return {"jobs": n, "refused": sum(1 for r in sent if r.error), "succeeded": len(waits),
            "queue_wait_ms": percentiles(waits), "total_ms": percentiles(totals),
            "batch_sizes": round(sum(job["batch_size"] for job in jobs) / max(1, len(jobs)), 2)}


def write_inputs(folder: Path, *, jsonl_rows: int, parquet_rows: int) -> tuple[Path, Path, set[int]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = skewed_texts(jsonl_rows, seed=7)
    bad = {row for row in range(jsonl_rows) if row % BAD_EVERY == BAD_EVERY - 1}
    jsonl = folder / "calls.jsonl"
    with jsonl.open("w") as handle:
        for row, text in enumerate(texts):
            handle.write(json.dumps({"id": row, "text": 12345 if row in bad else text}) + "\n")
    parquet = folder / "tickets.parquet"
    pq.write_table(pa.table({"text": skewed_texts(parquet_rows, seed=8)}), parquet, row_group_size=2048)
    return jsonl, parquet, bad


def check_output(client: httpx.Client, batch_id: str, rows: int, bad: set[int]) -> dict[str, Any]:
    response = client.get(f"/v1/batches/{batch_id}/output")
    response.raise_for_status()
    lines = [json.loads(line) for line in response.content.splitlines()]
    in_order = [line["row"] for line in lines] == list(range(rows))
    failed = {line["row"] for line in lines if line["status"] != "succeeded"}
    return {"rows": len(lines), "in_input_order": in_order, "failed_rows_as_seeded": failed == bad,
            "failed": len(failed)}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rate", type=float, default=10.0, help="online jobs/s")
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of online load per phase")
    parser.add_argument("--jsonl-rows", type=int, default=20_000)
    parser.add_argument("--parquet-rows", type=int, default=5_000)
    parser.add_argument("--output", default="batch_scoring.json")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"machine": machine_info(), "command": command_line("bench.batch_scoring"),
                               "percentile_method": PERCENTILE_METHOD, "args": vars(args)}
    with sigterm_as_interrupt(), BenchPlatform() as platform, tempfile.TemporaryDirectory() as tmp:
        batch_root = Path(tmp)
        platform.start_workers(MODEL, VERSION, args.workers)
        platform.wait_ready(MODEL, VERSION, args.workers)
        celery = start_celery(platform, batch_root)
        try:
            online_phase(platform, rate=args.rate, duration_s=5, seed=99)  # warm-up, not reported
            results["online_alone"] = online_phase(platform, rate=args.rate, duration_s=args.duration, seed=1)
            jsonl, parquet, bad = write_inputs(batch_root, jsonl_rows=args.jsonl_rows, parquet_rows=args.parquet_rows)
            with httpx.Client(base_url=platform.api_url, timeout=120,
                              headers={"Authorization": f"Bearer {platform.demo_key}"}) as client:
                started = time.monotonic()
                batches = []
                for path, rows, seeded in ((jsonl, args.jsonl_rows, bad), (parquet, args.parquet_rows, set())):
                    with path.open("rb") as handle:
                        response = client.post("/v1/batches", data={"model": MODEL},
                                               files={"file": (path.name, handle, "application/octet-stream")})
                    response.raise_for_status()
                    batches.append((response.json()["id"], rows, seeded))
                # The online phase starts once the feeders have filled the bulk lane.
                while client.get(f"/v1/batches/{batches[0][0]}").json()["done"] == 0:
                    time.sleep(0.5)
                results["online_with_batches"] = online_phase(platform, rate=args.rate, duration_s=args.duration,
                                                              seed=1)
                online_ended = time.monotonic()
                finals = []
                for batch_id, rows, seeded in batches:
                    while (batch := client.get(f"/v1/batches/{batch_id}").json())["finished_at"] is None:
                        time.sleep(1)
                    finals.append({**batch, "check": check_output(client, batch_id, rows, seeded)})
                elapsed = time.monotonic() - started
                results["batches"] = finals
                results["batch_rows_per_s"] = round((args.jsonl_rows + args.parquet_rows) / elapsed, 1)
                results["online_overlapped_batches"] = online_ended < started + elapsed
        finally:
            stop_processes([celery])
    alone, loaded = results["online_alone"], results["online_with_batches"]
    rows = [[name, phase["succeeded"], phase["refused"], *(phase["queue_wait_ms"][q] for q in ("p50", "p95", "p99")),
             phase["total_ms"]["p99"], phase["batch_sizes"]]
            for name, phase in (("online alone", alone), ("online + batches", loaded))]
    print(table(["phase", "jobs", "refused", "wait p50", "wait p95", "wait p99", "total p99", "mean batch"],
                [[cell if not isinstance(cell, float) or math.isnan(cell) else round(cell, 1) for cell in row]
                 for row in rows]))
    for batch in results["batches"]:
        print(f"batch {batch['id']}: {batch['status']}, {batch['done']} done, {batch['failed']} failed of "
              f"{batch['total']}; output {batch['check']}")
    for q in ("p50", "p95", "p99"):
        with_batches, without = loaded["queue_wait_ms"][q], alone["queue_wait_ms"][q]
        if with_batches is not None and without:
            results[f"{q}_queue_wait_ratio"] = round(with_batches / without, 2)
            print(f"online {q} queue wait with the batches running: {with_batches:.1f} ms against {without:.1f} ms "
                  "without")
    print(f"batches fed at {results['batch_rows_per_s']} rows/s")
    print(f"wrote {write_json(args.output, results)}")


if __name__ == "__main__":
    main()
