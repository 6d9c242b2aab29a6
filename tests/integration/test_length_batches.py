"""How a worker batches mixed lengths depends on its handler: one that pads a batch to its longest
input gets length groups; one that plans its own forward passes (MiniLM) gets everything ready
at once, run pass by pass in its plan's order and stored pass by pass, so a queue of mixed
lengths runs as full passes instead of fragments and a short job does not wait for a long one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import pytest
import redis.asyncio as aioredis

from sluice.kinds import ModelKind
from sluice.wire.connections import connect
from tests.support import drive, queue_in_redis, unique
from workers.models.protocol import ModelHandler
from workers.worker import Worker


class BatchRecorder(ModelHandler):
    kind = ModelKind.synthetic

    def __init__(self, *, length_buckets: bool) -> None:
        self.length_buckets = length_buckets
        self.batches: list[list[str]] = []

    def warmup(self) -> None:
        """Nothing to warm."""

    def passes(self, inputs: Sequence[Mapping[str, Any]]) -> list[list[int]]:
        words = [len(item["text"].split()) for item in inputs]
        short = [i for i, n in enumerate(words) if n <= 40]
        return [part for part in (short, [i for i, n in enumerate(words) if n > 40]) if part]

    def run(self, inputs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        self.batches.append([item["text"] for item in inputs])
        time.sleep(0.05)  # so a pass stored after another has a later finished_at
        return [{"n": len(item["text"])} for item in inputs]


@pytest.fixture
async def aredis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = connect(redis_url, max_connections=8)
    yield client
    await client.aclose()


@pytest.mark.parametrize("length_buckets", [True, False])
async def test_a_handler_that_splits_by_length_is_handed_mixed_lengths_in_one_batch(
    aredis: aioredis.Redis, length_buckets: bool,
) -> None:
    model = unique("lengths")
    # Twelve lengths from 2 to 200 words: twelve different length buckets.
    texts = [" ".join(["word"] * n) for n in (2, 200, 5, 120, 9, 60, 14, 33, 21, 90, 3, 150)]
    ids = await queue_in_redis(aredis, model, [{"text": text} for text in texts])
    handler = BatchRecorder(length_buckets=length_buckets)
    worker = Worker(redis=aredis, model=model, version="v1", handler=handler, max_batch_size=32,
                    max_wait_ms=5, shutdown_grace_s=5)

    records = await drive([worker], aredis, ids, timeout_s=20)

    assert {record["status"] for record in records.values()} == {"succeeded"}
    assert sorted(text for batch in handler.batches for text in batch) == sorted(texts)
    if length_buckets:
        # Never a 2-word text padded to a 200-word one.
        for batch in handler.batches:
            words = [len(text.split()) for text in batch]
            assert max(words) <= 2 * min(words) + 2, words
        assert len(handler.batches) > 4
    else:
        # One batch of all twelve, run as the handler's two passes, short first, each oldest first.
        short = [text for text in texts if len(text.split()) <= 40]
        long = [text for text in texts if len(text.split()) > 40]
        assert handler.batches == [short, long]
        finished = {text: float(records[job_id]["finished_at"]) for job_id, text in zip(ids, texts, strict=True)}
        assert max(finished[text] for text in short) < min(finished[text] for text in long)


async def test_the_pass_holding_the_oldest_job_runs_first(aredis: aioredis.Redis) -> None:
    model = unique("lengths-age")
    long = [" ".join(["word"] * n) for n in (120, 90)]
    short = [" ".join(["word"] * n) for n in (3, 12, 7)]
    ids = await queue_in_redis(aredis, model, [{"text": text} for text in long])
    await asyncio.sleep(0.02)
    ids += await queue_in_redis(aredis, model, [{"text": text} for text in short])
    handler = BatchRecorder(length_buckets=False)
    worker = Worker(redis=aredis, model=model, version="v1", handler=handler, max_batch_size=32,
                    max_wait_ms=5, shutdown_grace_s=5)

    records = await drive([worker], aredis, ids, timeout_s=20)

    assert {record["status"] for record in records.values()} == {"succeeded"}
    # The long jobs were queued first: their pass runs first, though the plan lists it second.
    assert handler.batches == [long, short]
