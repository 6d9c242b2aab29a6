"""Moving jobs through their states as a worker would, without running one: for benches that
measure the API alone.

The writes are the kernel's own (`StreamConsumer.claim` and `.finish`, the scripts a worker runs),
so the records, samples and events are what a real worker leaves. `finish_jobs` makes queued jobs
`succeeded` at once, with no event (nobody waits on them). `Progress` plays a worker behind
long-polls that are already waiting: a set time after each request went out, it claims the job
(`running`) and later finishes it, publishing both events as the worker does.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis

from sluice import events
from sluice.jobs import JobStatus
from sluice.samples import Sample
from sluice.streams import Delivered, StreamConsumer, StreamEntry

EMBEDDING_DIM = 384


def embedding_output(seed: int) -> str:
    """An output as a MiniLM worker stores it: a unit vector of float32 values, as JSON."""
    import numpy as np

    vector = np.random.default_rng(seed).standard_normal(EMBEDDING_DIM).astype(np.float32)
    vector /= np.linalg.norm(vector)
    return json.dumps({"embedding": vector.tolist(), "dim": EMBEDDING_DIM}, separators=(",", ":"))


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


async def _finish(consumer: StreamConsumer, pipe: Any, job_id: str, *, output: str, announce: bool) -> None:
    now = time.time()
    sample = Sample(
        status="succeeded",
        finished_at=now,
        queue_wait_ms=1.0,
        model_ms=5.0,
        total_ms=6.0,
        batch_size=32,
        close_reason="size",
    )
    await consumer.finish(
        pipe,
        job_id,
        status="succeeded",
        output=output,
        error="",
        started=now - 0.005,
        finished=now,
        model_ms=5.0,
        batch_size=32,
        close_reason="size",
        sample=sample,
        event=events.JobChanged(id=job_id, status=JobStatus.succeeded) if announce else None,
    )


async def _finish_all(redis_url: str, model: str, version: str, job_ids: Sequence[str]) -> None:
    client = aioredis.Redis.from_url(redis_url)
    consumer = _consumer(client, model, version)
    try:
        for start in range(0, len(job_ids), 500):
            chunk = job_ids[start : start + 500]
            pipe = client.pipeline(transaction=False)
            for index, job_id in enumerate(chunk):
                await _finish(consumer, pipe, job_id, output=embedding_output(start + index), announce=False)
            if await pipe.execute() != [1] * len(chunk):
                raise RuntimeError("the finish script refused some of the bench's jobs")
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
        claims = await self.consumer.claim([Delivered("online", "0-1", entry)], now=time.time())
        if claims[0].verdict != "run":
            raise RuntimeError(f"the claim script answered {claims[0].verdict} for a queued job")
        await events.publish(self.client, events.JobChanged(id=job_id, status=JobStatus.running))
        await asyncio.sleep(self.final_after_s - self.running_after_s)
        pipe = self.client.pipeline(transaction=False)
        await _finish(self.consumer, pipe, job_id, output=self.output, announce=True)
        if await pipe.execute() != [1]:
            raise RuntimeError("the finish script refused a job it had claimed")

    async def close(self) -> None:
        """Wait for every job scheduled to be finished, then let go of Redis."""
        try:
            await asyncio.gather(*self._tasks)
        finally:
            await self.client.aclose()
