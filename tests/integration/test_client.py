"""The Python clients against the real API (in process) and Redis, with an in-process synthetic
worker where jobs must run; jobs that must stay pending go to a model no worker serves."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import redis.asyncio as aioredis

from launch.seed import Seeded
from sluice.client import AsyncClient, ClientError, WaitTimeout
from sluice.connections import connect
from tests.support import ApiServer
from workers.consumer import Worker
from workers.models.synthetic import SyntheticHandler


@pytest.fixture
async def aredis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = connect(redis_url, max_connections=8)
    yield client
    await client.aclose()


@pytest.fixture
def client(api: ApiServer, seeded: Seeded) -> Iterator[Callable[..., AsyncClient]]:
    def make(**options: Any) -> AsyncClient:
        return AsyncClient(base_url=api.url, api_key=seeded.demo_key, **options)

    yield make


@asynccontextmanager
async def running(redis: aioredis.Redis, model: str) -> AsyncIterator[Worker]:
    """A worker for `model` v1 on this event loop, drained on exit."""
    worker = Worker(
        redis=redis,
        model=model,
        version="v1",
        max_batch_size=16,
        max_wait_ms=5,
        handler=SyntheticHandler(fixed_s=0.001, per_item_s=0.0, per_token_s=0.0),
        shutdown_grace_s=5,
    )
    task = asyncio.create_task(worker.run())
    try:
        yield worker
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, timeout=30)


async def test_async_client_submits_reads_and_cancels(
    client: Callable[..., AsyncClient],
    register_synthetic: Callable[..., str],
) -> None:
    model = register_synthetic("aclient")  # no worker: its jobs stay queued
    async with client() as sluice:
        job = await sluice.submit(model, {"text": "one"}, metadata={"order": 7})
        assert job["status"] == "queued" and job["model"] == model and job["metadata"] == {"order": 7}
        assert (await sluice.job(job["id"]))["id"] == job["id"]
        ids = await sluice.submit_bulk(model, [{"text": "two"}, {"text": "three"}])
        assert len(ids) == 2 and len(set(ids)) == 2
        assert (await sluice.cancel(job["id"]))["status"] == "cancelled"
        assert (await sluice.wait(job["id"], timeout_s=5))["status"] == "cancelled"


async def test_async_client_idempotency_key_replays_the_same_job(
    client: Callable[..., AsyncClient],
    register_synthetic: Callable[..., str],
) -> None:
    model = register_synthetic("aclient-idem")
    async with client() as sluice:
        first = await sluice.submit(model, {"text": "once"}, idempotency_key="k-1")
        again = await sluice.submit(model, {"text": "once"}, idempotency_key="k-1")
    assert again["id"] == first["id"]


async def test_async_client_raises_the_api_error(
    client: Callable[..., AsyncClient],
    register_synthetic: Callable[..., str],
) -> None:
    model = register_synthetic("aclient-err")
    async with client() as sluice:
        with pytest.raises(ClientError) as missing:
            await sluice.job("job_doesnotexist")
        with pytest.raises(ClientError) as invalid:
            await sluice.submit(model, {"words": "no text"})
    assert (missing.value.status, missing.value.code) == (404, "not_found")
    assert invalid.value.status == 422


async def test_async_client_wait_raises_a_timeout_naming_the_job(
    client: Callable[..., AsyncClient],
    register_synthetic: Callable[..., str],
) -> None:
    model = register_synthetic("aclient-timeout")
    async with client() as sluice:
        job = await sluice.submit(model, {"text": "never runs"})
        started = time.monotonic()
        with pytest.raises(WaitTimeout) as timeout:
            await sluice.wait(job["id"], timeout_s=0.5)
    assert 0.4 < time.monotonic() - started < 5
    assert timeout.value.pending == [job["id"]] and job["id"] in str(timeout.value)
    assert isinstance(timeout.value, TimeoutError)


async def test_async_client_many_concurrent_submits_and_waits(
    client: Callable[..., AsyncClient],
    register_synthetic: Callable[..., str],
    aredis: aioredis.Redis,
) -> None:
    model = register_synthetic("aclient-run")
    texts = [f"text number {i}" for i in range(24)]
    async with running(aredis, model), client(max_connections=8) as sluice:
        submitted = await asyncio.gather(*(sluice.submit(model, {"text": t}) for t in texts))
        jobs = await asyncio.gather(*(sluice.wait(job["id"], timeout_s=30) for job in submitted))
    assert [job["status"] for job in jobs] == ["succeeded"] * len(texts)
    assert [job["output"]["echo"]["text"] for job in jobs] == texts
