"""Noisy neighbour: one version's flood against another version's steady single jobs, both served
by ONE worker process (two Workers on one event loop, sharing its execution slots), on real Redis.

The quiet version's queue wait (started minus enqueued) is measured alone, then beside a flood on
the other version, and reported as a ratio with its spread over repeats; the bound the process
promises is the quiet version's `max_wait_ms` plus one of the flood's batches on the model
(docs/ARCHITECTURE.md, "Execution turns in a shared process").

    python -m bench.noisy_neighbour --redis-url redis://127.0.0.1:6379/0 [--flood 5000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import subprocess
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

import redis.asyncio as aioredis

from bench.output import command_line, table, write_json
from sluice.wire import keys
from sluice.wire.jobs import JobRecord, JobStatus
from sluice.wire.keys import new_job_id
from sluice.wire.streams import queue_jobs
from workers.models.synthetic import SyntheticHandler
from workers.slots import ExecutionSlots
from workers.worker import Worker

FLOOD = dict(fixed_s=0.01, per_item_s=0.002, per_token_s=0.0)  # a batch of 16: 42 ms on the model
QUIET = dict(fixed_s=0.002, per_item_s=0.001, per_token_s=0.0)
FLOOD_BATCH, QUIET_BATCH, QUIET_WAIT_MS = 16, 8, 5.0


@dataclass(frozen=True)
class Run:
    p50_ms: float
    p99_ms: float
    bound_ms: float  # the quiet version's max_wait_ms plus one flood batch's model time


async def _queue(redis: aioredis.Redis, model: str, count: int, lane: str) -> list[str]:
    now = time.time()
    records = [JobRecord(id=new_job_id(model, "v1"), tenant="bench", model=model, version="v1", lane=lane,  # type: ignore[arg-type]
                         status=JobStatus.queued, input={"text": f"job {i}"}, enqueued_at=now, cost=1)
               for i in range(count)]
    for start in range(0, len(records), 500):
        pipe = redis.pipeline(transaction=False)
        queue_jobs(pipe, records[start:start + 500], result_ttl_s=600)
        await pipe.execute()
    return [record.id for record in records]


async def _waits(redis: aioredis.Redis, ids: list[str]) -> list[float] | None:
    pipe = redis.pipeline(transaction=False)
    for job_id in ids:
        pipe.hmget(keys.job(job_id), "status", "started_at", "enqueued_at")
    rows = await pipe.execute()
    if any(status != b"succeeded" for status, _, _ in rows):
        return None
    return [(float(started) - float(enqueued)) * 1000 for _, started, enqueued in rows]


def _worker(redis: aioredis.Redis, model: str, slots: ExecutionSlots, cost: dict[str, float], batch: int,
            wait_ms: float) -> Worker:
    return Worker(redis=redis, model=model, version="v1", handler=SyntheticHandler(**cost), max_batch_size=batch,
                  max_wait_ms=wait_ms, isolate_tenants=False, slots=slots, prefetch_batches=2)


async def measure(redis_url: str, *, flood: int, quiet_jobs: int = 100, quiet_every_s: float = 0.05,
                  flood_lane: str = "bulk") -> Run:
    """The quiet version's queue wait with `flood` jobs queued on its neighbour (0: alone)."""
    redis = aioredis.Redis.from_url(redis_url)
    run = uuid.uuid4().hex[:8]
    noisy, quiet = f"noisy-{run}", f"quiet-{run}"
    slots = ExecutionSlots(slots=1)
    workers = [_worker(redis, noisy, slots, FLOOD, FLOOD_BATCH, 50.0),
               _worker(redis, quiet, slots, QUIET, QUIET_BATCH, QUIET_WAIT_MS)]
    tasks = [asyncio.create_task(worker.run()) for worker in workers]
    try:
        await asyncio.sleep(0.3)  # both consumer groups joined
        if flood:
            await _queue(redis, noisy, flood, flood_lane)
            await asyncio.sleep(0.5)  # the flood under way
        ids: list[str] = []
        for _ in range(quiet_jobs):
            ids += await _queue(redis, quiet, 1, "online")
            await asyncio.sleep(quiet_every_s)
        deadline = time.monotonic() + 60
        while (waits := await _waits(redis, ids)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError("the quiet version's jobs did not finish")
            await asyncio.sleep(0.1)
    finally:
        for worker in workers:
            worker.request_stop()
        for worker in workers:
            worker.batcher.drain(time.time())  # the flood's rest is not this measurement's
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for model in (noisy, quiet):
            await redis.delete(*(keys.stream(model, "v1", lane) for lane in ("online", "bulk")))
        await redis.aclose()
    ordered = sorted(waits)
    flood_batch_ms = (FLOOD["fixed_s"] + FLOOD_BATCH * FLOOD["per_item_s"]) * 1000
    return Run(p50_ms=statistics.median(ordered), p99_ms=ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
               bound_ms=QUIET_WAIT_MS + flood_batch_ms)


def host() -> dict[str, Any]:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        lscpu = ""
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in lscpu.splitlines() if line.startswith("Flags")), [])
    return {"cpu": model or platform.processor(), "flags": [f for f in ("avx512_bf16", "amx_bf16", "avx512_vnni")
                                                            if f in flags]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--flood", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs: dict[str, list[tuple[Run, Run]]] = {"bulk": [], "online": []}
    for flood_lane, pairs in runs.items():
        for _ in range(args.repeats):
            alone = asyncio.run(measure(args.redis_url, flood=0))
            pairs.append((alone, asyncio.run(measure(args.redis_url, flood=args.flood, flood_lane=flood_lane))))
    summary = {}
    for flood_lane, pairs in runs.items():
        ratios = [flooded.p99_ms / alone.p99_ms for alone, flooded in pairs]
        summary[flood_lane] = {"p99_ratio_median": statistics.median(ratios), "p99_ratio_min": min(ratios),
                               "p99_ratio_max": max(ratios),
                               "flooded_p99_ms_max": max(flooded.p99_ms for _, flooded in pairs),
                               "bound_ms": pairs[0][1].bound_ms,
                               "runs": [{"alone": asdict(a), "flooded": asdict(f)} for a, f in pairs]}
    rows = [[lane, ", ".join(f"{a.p99_ms:.1f}" for a, _ in runs[lane]),
             ", ".join(f"{f.p99_ms:.1f}" for _, f in runs[lane]),
             f"{s['p99_ratio_median']:.1f}x ({s['p99_ratio_min']:.1f}-{s['p99_ratio_max']:.1f})",
             f"{s['bound_ms']:.0f}"] for lane, s in summary.items()]
    print(table(["flood lane", "B alone p99 ms", "B beside the flood p99 ms", "p99 ratio", "bound ms"], rows))
    path = write_json("noisy_neighbour.json", {"command": command_line("bench.noisy_neighbour"), "host": host(),
                                               "flood": args.flood, "repeats": args.repeats, "summary": summary})
    print(f"written to {path}")


if __name__ == "__main__":
    main()
