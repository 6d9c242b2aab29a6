"""A worker whose own loop dies stops, rather than go on claiming jobs it never runs while its
heartbeat says ready (and its refreshes keep every other worker off them)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import pytest
import redis.asyncio as aioredis

from sluice.errors import WorkerFailed
from sluice.kinds import ModelKind
from sluice.wire.connections import connect
from tests.support import queue_in_redis, unique
from workers.models.protocol import ModelHandler
from workers.worker import LOOP_STOP_S, Worker


class BrokenPlanner(ModelHandler):
    """Plans its own forward passes, and its planner has a bug (not an input's fault)."""

    kind = ModelKind.synthetic
    length_buckets = False

    def warmup(self) -> None:
        """Nothing to warm."""

    def passes(self, inputs: Sequence[Mapping[str, Any]]) -> list[list[int]]:
        raise AttributeError("'BrokenPlanner' object has no attribute 'plan'")

    def run(self, inputs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        return [{"n": 1} for _ in inputs]


@pytest.fixture
async def aredis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = connect(redis_url, max_connections=8)
    yield client
    await client.aclose()


async def test_a_worker_whose_runner_dies_stops_instead_of_holding_jobs(aredis: aioredis.Redis) -> None:
    model = unique("broken")
    await queue_in_redis(aredis, model, [{"text": f"job {i}"} for i in range(4)])
    worker = Worker(redis=aredis, model=model, version="v1", handler=BrokenPlanner(), max_batch_size=8,
                    max_wait_ms=5, shutdown_grace_s=5)
    started = time.monotonic()
    with pytest.raises(WorkerFailed, match="runner") as failed:
        await asyncio.wait_for(worker.run(), timeout=10)
    assert isinstance(failed.value.__cause__, AttributeError)
    # Every loop stopped on its cancellation, within the bound on stopping (redis-py may take the
    # cancellation of a blocking read for a lost connection and read again): none is left over.
    assert time.monotonic() - started < LOOP_STOP_S
    assert [task for task in asyncio.all_tasks() if task is not asyncio.current_task()] == []
    assert worker.state.value == "stopped"
