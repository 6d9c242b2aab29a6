"""Moving jobs through their states as a worker would, without running one: for benches that
measure the API alone.

The writes are the kernel's own (`StreamConsumer.claim` and `.finish`, the scripts a worker runs),
so the records, samples and events are what a real worker leaves. `finish_jobs` makes queued jobs
`succeeded` at once, with no event (nobody waits on them). `Progress` plays a worker behind
long-polls that are already waiting: a set time after each request went out, it claims the job
(`running`) and later finishes it, each script publishing its event as for a worker.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import orjson
import redis.asyncio as aioredis

from sluice.wire.entries import Delivered, StreamEntry
from sluice.wire.samples import Sample
from sluice.wire.script_calls import Finished
from sluice.wire.streams import StreamConsumer

EMBEDDING_DIM = 384


def embedding_output(seed: int) -> str:
    """An output as a MiniLM worker stores it: a unit vector of float32 values, as JSON (orjson, as
    workers/results.py writes it)."""
    import numpy as np

    vector = np.random.default_rng(seed).standard_normal(EMBEDDING_DIM).astype(np.float32)
    vector /= np.linalg.norm(vector)
    return orjson.dumps({"embedding": vector.tolist(), "dim": EMBEDDING_DIM}).decode()


def _consumer(client: aioredis.Redis, model: str, version: str) -> StreamConsumer:
    return StreamConsumer(
        redis=client,
        model=model,
        version=version,
        name="bench-worker",
        claim_after_s=30.0,
        max_deliveries=3,
        result_ttl_s=86_400,
    )


def _sample() -> Sample:
    return Sample(
        status="succeeded",
        finished_at=time.time(),
        queue_wait_ms=1.0,
        model_ms=5.0,
        total_ms=6.0,
        batch_size=32,
        close_reason="size",
    )


async def _finish(consumer: StreamConsumer, job_ids: Sequence[str], outputs: Sequence[str], *, announce: bool) -> None:
    """One batch's outcomes in one call of the finish script, as a worker stores them. The entry
    ids are placeholders: nobody reads the bench's streams, so nothing is left to acknowledge."""
    now = time.time()
    jobs = [
        Finished(
            job_id=job_id,
            lane="online",
            entry_id="0-1",
            status="succeeded",
            output=output,
            error="",
            sample=_sample(),
            announce=announce,
        )
        for job_id, output in zip(job_ids, outputs, strict=True)
    ]
    won = await consumer.finish(
        jobs, faults=[], started=now - 0.005, finished=now, model_ms=5.0, batch_size=len(jobs), close_reason="size"
    )
    if not all(won):
        raise RuntimeError("the finish script refused some of the bench's jobs")


async def _finish_all(redis_url: str, model: str, version: str, job_ids: Sequence[str]) -> None:
    client = aioredis.Redis.from_url(redis_url)
    consumer = _consumer(client, model, version)
    try:
        for start in range(0, len(job_ids), 500):
            chunk = job_ids[start : start + 500]
            outputs = [embedding_output(start + index) for index in range(len(chunk))]
            await _finish(consumer, chunk, outputs, announce=False)
    finally:
        await client.aclose()


def finish_jobs(redis_url: str, model: str, version: str, job_ids: Sequence[str]) -> None:
    """Make queued jobs `succeeded` at once, as a worker's finish would (a sample, no event)."""
    asyncio.run(_finish_all(redis_url, model, version, job_ids))


class Progress:
    """A worker's two steps for each job handed to `schedule`: claimed `running_after_s` later,
    finished `final_after_s` later, each with its event. Runs on the caller's event loop."""

    def __init__(
        self, *, redis_url: str, model: str, version: str, tenant: str, running_after_s: float, final_after_s: float
    ) -> None:
        self.client = aioredis.Redis.from_url(redis_url)
        self.consumer = _consumer(self.client, model, version)
        self.tenant = tenant
        self.running_after_s = running_after_s
        self.final_after_s = final_after_s
        self.output = embedding_output(0)
        self._tasks: set[asyncio.Task[None]] = set()

    def schedule(self, job_id: str) -> None:
        task = asyncio.create_task(self._advance(job_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _advance(self, job_id: str) -> None:
        await asyncio.sleep(self.running_after_s)
        entry = StreamEntry(job_id=job_id, tenant=self.tenant, cost=1, enqueued_at=time.time())
        # The claim script announces `running` itself, as for a worker.
        claims = await self.consumer.claim([Delivered("online", "0-1", entry)], now=time.time())
        if claims[0].verdict != "run":
            raise RuntimeError(f"the claim script answered {claims[0].verdict} for a queued job")
        await asyncio.sleep(self.final_after_s - self.running_after_s)
        await _finish(self.consumer, [job_id], [self.output], announce=True)

    async def close(self) -> None:
        """Wait for every job scheduled to be finished, then let go of Redis."""
        try:
            await asyncio.gather(*self._tasks)
        finally:
            await self.client.aclose()
