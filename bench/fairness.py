"""Tenant fairness: one tenant floods a version's bulk lane while another sends single jobs to the
same lane at a fifth of its capacity; one worker (a real `Worker` on this event loop) serves it,
over real Redis, through the enqueue script the API runs (holding included).

The trickle's queue wait (started minus enqueued) is measured with the flood idle, with it under
way, and under way with fair sharing off (`SLUICE_FAIR_SHARE=false`: arrival order), and reported
as ratios to the idle case, with their spread over repeats (docs/ARCHITECTURE.md, "Priority and
fair sharing"). The same scenario runs in the simulator (scheduler/planning/fairness_sim.py).

    python -m bench.fairness --redis-url redis://127.0.0.1:6379/0 [--flood 20000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
import uuid
from dataclasses import asdict, dataclass

import redis.asyncio as aioredis

from bench.noisy_neighbour import host
from bench.output import command_line, table, write_json
from sluice.wire import keys
from sluice.wire.broker import Broker
from sluice.wire.jobs import JobRecord, JobStatus
from sluice.wire.keys import new_job_id
from sluice.wire.quota import TenantLimits
from workers.models.synthetic import SyntheticHandler
from workers.worker import Worker

COST = dict(fixed_s=0.002, per_item_s=0.003, per_token_s=0.0)  # a batch of 16: 50 ms on the model
BATCH, WAIT_MS = 16, 10.0
CAPACITY = BATCH / (COST["fixed_s"] + BATCH * COST["per_item_s"])  # jobs a second, in full batches


@dataclass(frozen=True)
class Run:
    p50_ms: float
    p99_ms: float
    flood_done: int  # of the flood's jobs, finished while the trickle ran


def _records(model: str, tenant: str, count: int) -> list[JobRecord]:
    now = time.time()
    return [JobRecord(id=new_job_id(model, "v1"), tenant=tenant, model=model, version="v1", lane="bulk",
                      status=JobStatus.queued, input={"text": f"job {i}"}, enqueued_at=now, cost=1)
            for i in range(count)]


async def _enqueue(broker: Broker, records: list[JobRecord], *, window: int) -> None:
    limits = TenantLimits(tenant=records[0].tenant, rate_per_s=1e9, burst=10**9, max_queued=10**9,
                          max_answered=10**9)
    for start in range(0, len(records), 1000):
        refusal = await broker.enqueue(records[start:start + 1000], limits=limits, window=window)
        assert refusal is None, refusal


async def _finished(redis: aioredis.Redis, ids: list[str]) -> list[tuple[bytes | None, ...]]:
    pipe = redis.pipeline(transaction=False)
    for job_id in ids:
        pipe.hmget(keys.job(job_id), "status", "started_at", "enqueued_at")
    return list(await pipe.execute())


async def measure(redis_url: str, *, flood: int, fair: bool = True, trickle_jobs: int = 300,
                  trickle_share: float = 0.2, seed: int = 0) -> Run:
    """The trickle tenant's queue wait with `flood` jobs of another tenant queued first (0: alone)."""
    redis = aioredis.Redis.from_url(redis_url)
    model = f"fair-{uuid.uuid4().hex[:8]}"
    broker = Broker(redis=redis, result_ttl_s=600)
    window = BATCH if fair else 0
    worker = Worker(redis=redis, model=model, version="v1", handler=SyntheticHandler(**COST), max_batch_size=BATCH,
                    max_wait_ms=WAIT_MS, fair_share=fair, prefetch_batches=2)
    task = asyncio.create_task(worker.run())
    flood_ids: list[str] = []
    try:
        await asyncio.sleep(0.3)  # the consumer group joined
        if flood:
            flooding = _records(model, "flood", flood)
            flood_ids = [record.id for record in flooding]
            await _enqueue(broker, flooding, window=window)
            await asyncio.sleep(1.0)  # the flood under way, its rate measured
        rng = random.Random(seed)
        ids: list[str] = []
        for _ in range(trickle_jobs):
            single = _records(model, "trickle", 1)
            await _enqueue(broker, single, window=window)
            ids.append(single[0].id)
            await asyncio.sleep(rng.expovariate(trickle_share * CAPACITY))
        # Without the rule the trickle waits for the whole flood: allow for it on a slow host.
        deadline = time.monotonic() + 60 + 3 * flood / CAPACITY
        while True:
            rows = await _finished(redis, ids)
            if all(row[0] == b"succeeded" for row in rows):
                break
            if time.monotonic() > deadline:
                raise TimeoutError("the trickle's jobs did not finish")
            await asyncio.sleep(0.1)
        done = sum(1 for row in await _finished(redis, flood_ids) if row[0] == b"succeeded") if flood_ids else 0
    finally:
        worker.request_stop()
        worker.batcher.drain(time.time())  # the flood's rest is not this measurement's
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for pattern in (f"sluice:{keys.tag(model, 'v1')}:*",):
            async for key in redis.scan_iter(match=pattern.replace("{", "[{]").replace("}", "[}]"), count=1000):
                await redis.delete(key)
        await redis.aclose()
    waits = sorted((float(started) - float(enqueued)) * 1000 for _, started, enqueued in rows  # type: ignore[arg-type]
                   )
    return Run(p50_ms=statistics.median(waits), p99_ms=waits[min(len(waits) - 1, int(0.99 * len(waits)))],
               flood_done=done)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--flood", type=int, default=20_000)
    parser.add_argument("--trickle-jobs", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for repeat in range(args.repeats):
        idle = asyncio.run(measure(args.redis_url, flood=0, trickle_jobs=args.trickle_jobs, seed=repeat))
        fair = asyncio.run(measure(args.redis_url, flood=args.flood, trickle_jobs=args.trickle_jobs, seed=repeat))
        unfair = asyncio.run(measure(args.redis_url, flood=args.flood, fair=False, trickle_jobs=args.trickle_jobs,
                                     seed=repeat))
        rows.append({"idle": asdict(idle), "fair": asdict(fair), "unfair": asdict(unfair),
                     "fair_ratio": fair.p99_ms / idle.p99_ms, "unfair_ratio": unfair.p99_ms / idle.p99_ms})
    summary = {}
    for name in ("fair_ratio", "unfair_ratio"):
        values = [row[name] for row in rows]
        summary[name] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    print(table(["run", "idle p99 ms", "fair p99 ms", "unfair p99 ms", "fair/idle", "unfair/idle"],
                [[str(i), f"{row['idle']['p99_ms']:.1f}", f"{row['fair']['p99_ms']:.1f}",  # type: ignore[index]
                  f"{row['unfair']['p99_ms']:.1f}", f"{row['fair_ratio']:.2f}", f"{row['unfair_ratio']:.1f}"]
                 for i, row in enumerate(rows)]))
    write_json("fairness.json", {"command": command_line("bench.fairness"), "host": host(), "runs": rows,
                            "summary": summary})


if __name__ == "__main__":
    main()
