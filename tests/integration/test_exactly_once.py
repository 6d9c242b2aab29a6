"""A worker's exactly-once rules, in process over real Redis: the one
write that counts when a job is stored twice, a worker-side fault that is retried and then
dead-lettered with its real error, and the holder's refresh of what it holds.

The 500-job run with workers whose batches outlast the claim threshold is tests/faults/test_steal.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import pytest
import redis.asyncio as aioredis

from sluice.batcher import Batch, Item
from sluice.errors import WorkerFailed
from sluice.kinds import ModelKind
from sluice.wire import events, keys
from sluice.wire.connections import connect
from sluice.wire.entries import DeadLetter
from sluice.wire.streams import StreamConsumer
from tests.support import drive, lane_jobs_async, queue_in_redis, unique
from workers.execution import Outcome
from workers.models.protocol import ModelHandler
from workers.results import Delivery, ResultWriter
from workers.worker import Worker


@pytest.fixture
async def aredis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = connect(redis_url, max_connections=8)
    yield client
    await client.aclose()


def consumer(redis: aioredis.Redis, model: str, name: str, *, claim_after_s: float = 0.2) -> StreamConsumer:
    return StreamConsumer(
        redis=redis,
        model=model,
        version="v1",
        name=name,
        claim_after_s=claim_after_s,
        max_deliveries=3,
        result_ttl_s=3600,
    )


async def pending_entry(redis: aioredis.Redis, model: str, entry_id: str) -> dict[str, Any] | None:
    """The entry's line of the group's pending list (owner, idle ms, deliveries), or None."""
    found = await redis.xpending_range(
        keys.stream(model, "v1", "online"), keys.GROUP, min=entry_id, max=entry_id, count=1
    )
    return found[0] if found else None


# --- one write counts ---------------------------------------------------------------------------------


async def test_a_second_store_of_a_finished_job_adds_no_sample_copy_or_event(aredis: aioredis.Redis) -> None:
    model = unique("twice")
    streams = consumer(aredis, model, "writer")
    await streams.ensure_groups()
    [job_id] = await queue_in_redis(aredis, model, [{"text": "stored twice"}], shadow="v2")
    [delivered] = await streams.read(["online"], count=10, block_ms=None)
    [claim] = await streams.claim([delivered], now=time.time())
    assert claim.verdict == "run"
    entry = delivered.entry
    batch = Batch(
        items=(
            Item(
                id=delivered.entry_id,
                tenant=entry.tenant,
                cost=entry.cost,
                enqueued_at=entry.enqueued_at,
                payload=Delivery(job_id=job_id, lane="online", input=claim.input, attempts=1, shadow="v2"),
            ),
        ),
        close_reason="size",
        bucket=0,
        tenant=None,
        closed_at=time.time(),
    )
    writer = ResultWriter(streams=streams, result_ttl_s=3600)
    channel = events.job_channel(aredis, job_id)
    # A cluster client's pub/sub reads no sharded messages: listen on the node that holds the
    # channel's slot, as the API's subscriptions do (api/job_subscriptions.py).
    if isinstance(aredis, aioredis.RedisCluster):
        node = aredis.get_node_from_key(channel)
        listener: aioredis.Redis = aioredis.Redis(host=node.host, port=node.port)
    else:
        listener = aredis
    pubsub = listener.pubsub()
    await pubsub.ssubscribe(channel)
    try:
        first = await writer.store(
            batch, [Outcome(output={"echo": "first"})], started=time.time(), finished=time.time(), model_ms=1.0
        )
        # The same job again: its entry was taken over by a second worker, which ran it too.
        second = await writer.store(
            batch, [Outcome(output={"echo": "second"})], started=time.time(), finished=time.time(), model_ms=1.0
        )
        announced = []
        until = time.monotonic() + 0.5
        while time.monotonic() < until:
            # None also stands for the subscription's own confirmation: read on until the time is up.
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1)
            if message is not None:
                announced.append(events.parse(message["data"]))
    finally:
        await pubsub.aclose()
        if listener is not aredis:
            await listener.aclose()

    assert (first, second) == ([True], [False])
    assert json.loads(await aredis.hget(keys.job(job_id), "output")) == {"echo": "first"}  # type: ignore[misc]
    assert await aredis.xlen(keys.stats(model, "v1")) == 1
    assert await lane_jobs_async(aredis, model, "v2", "bulk") == 1  # one shadow copy
    assert announced == [events.JobChanged(id=job_id, status="succeeded")]


# --- a worker-side fault is retried, then dead-lettered with its error -----------------------------------

MARK = "the marked input"


class FaultyHandler(ModelHandler):
    """Echoes its inputs, but a batch holding MARK raises what a broken device would: not an
    InferenceError (the input is not at fault), quoting the input as careless messages do."""

    kind = ModelKind.synthetic
    length_buckets = True

    def warmup(self) -> None:
        """Nothing to warm."""

    def run(self, inputs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        for item in inputs:
            if item["text"] == MARK:
                raise RuntimeError(f"device lost while running {item['text']!r}")
        return [{"echo": dict(item)} for item in inputs]


async def test_a_fault_is_retried_and_its_dead_letter_carries_the_real_error(aredis: aioredis.Redis) -> None:
    model = unique("fault")
    inputs = [{"text": f"ordinary text {i}"} for i in range(5)]
    inputs[2] = {"text": MARK}
    ids = await queue_in_redis(aredis, model, inputs)
    worker = Worker(
        redis=aredis,
        model=model,
        version="v1",
        handler=FaultyHandler(),
        max_batch_size=8,
        max_wait_ms=5,
        claim_after_s=0.3,
        max_deliveries=3,
        shutdown_grace_s=5,
    )

    records = await drive([worker], aredis, ids, timeout_s=30)

    marked = records.pop(ids[2])
    assert [r["status"] for r in records.values()] == ["succeeded"] * 4
    assert {r["attempts"] for r in records.values()} == {"1"}
    assert marked["status"] == "failed" and marked["attempts"] == "3", marked
    error = json.loads(marked["error"])
    assert error["code"] == "max_deliveries"
    assert "RuntimeError: device lost while running '[input]'" in error["message"], error
    letters = await aredis.xrange(keys.dead_stream(model, "v1"))
    assert [DeadLetter.from_fields(fields).job_id for _, fields in letters] == [ids[2]]
    [(_, fields)] = letters
    assert DeadLetter.from_fields(fields).error == "RuntimeError: device lost while running '[input]'"
    assert MARK not in marked["error"] and MARK not in marked["last_error"]
    # Only the four jobs that finished left a sample; the faulted runs stored no outcome.
    assert await aredis.xlen(keys.stats(model, "v1")) == 4
    assert await lane_jobs_async(aredis, model, "v1", "online") == 0


class Echo(ModelHandler):
    kind = ModelKind.synthetic
    length_buckets = True

    def warmup(self) -> None:
        """Nothing to warm."""

    def run(self, inputs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        return [{"echo": dict(item)} for item in inputs]


async def test_a_write_that_fails_other_than_on_redis_fails_the_worker_instead_of_holding_its_jobs(
    aredis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Storing retries Redis errors only. A write that failed otherwise left its jobs held (and kept
    fresh, so no other worker reclaimed them) by a worker that carried on as if healthy."""
    model = unique("write-fails")
    worker = Worker(redis=aredis, model=model, version="v1", handler=Echo(), max_batch_size=4, max_wait_ms=5,
                    claim_after_s=0.6, max_deliveries=3, shutdown_grace_s=5)

    async def broken(*args: object, **kwargs: object) -> list[bool]:
        raise ValueError("an outcome the writer could not encode")

    monkeypatch.setattr(worker.results, "store", broken)
    await queue_in_redis(aredis, model, [{"text": "held forever"}])
    with pytest.raises(WorkerFailed, match="storing a batch's outcomes failed") as failed:
        await asyncio.wait_for(worker.run(), timeout=10)
    assert isinstance(failed.value.__cause__, ValueError)


# --- the holder's refresh -----------------------------------------------------------------------------


async def test_a_refresh_resets_a_held_entry_s_idle_time_without_counting_a_delivery(
    aredis: aioredis.Redis,
) -> None:
    model = unique("refresh")
    holder, other = consumer(aredis, model, "holder"), consumer(aredis, model, "other")
    await holder.ensure_groups()
    await queue_in_redis(aredis, model, [{"text": "held a while"}])
    [delivered] = await holder.read(["online"], count=10, block_ms=None)
    await asyncio.sleep(0.3)
    before = await pending_entry(aredis, model, delivered.entry_id)
    assert before is not None and before["time_since_delivered"] >= 300, before

    assert await holder.refresh({"online": [delivered.entry_id]}) == set()

    after = await pending_entry(aredis, model, delivered.entry_id)
    assert after is not None, "the refresh dropped the entry from the pending list"
    assert after["consumer"] == b"holder" and after["times_delivered"] == 1, after
    assert after["time_since_delivered"] < 150, after
    # Past the threshold since it was read, but not since it was refreshed: nobody takes it over.
    assert await other.reclaim(10) == []


async def test_a_refresh_never_takes_back_an_entry_another_worker_took_over_nor_an_acknowledged_one(
    aredis: aioredis.Redis,
) -> None:
    model = unique("refresh")
    holder, other = consumer(aredis, model, "holder"), consumer(aredis, model, "other")
    await holder.ensure_groups()
    await queue_in_redis(aredis, model, [{"text": "taken over"}, {"text": "acknowledged"}])
    taken, acked = await holder.read(["online"], count=10, block_ms=None)
    pipe = aredis.pipeline(transaction=False)
    holder.ack(pipe, [(acked.lane, acked.entry_id)])
    await pipe.execute()
    await asyncio.sleep(0.3)  # the holder stalls past claim_after_s: the other worker takes over
    assert [d.entry_id for d in await other.reclaim(10)] == [taken.entry_id]

    lost = await holder.refresh({"online": [taken.entry_id, acked.entry_id]})

    assert lost == {taken.entry_id, acked.entry_id}
    owner = await pending_entry(aredis, model, taken.entry_id)
    assert owner is not None and owner["consumer"] == b"other" and owner["times_delivered"] == 2, owner
    assert await pending_entry(aredis, model, acked.entry_id) is None


class SlowRecorder(ModelHandler):
    """Sleeps a second per batch and records the texts of every batch it starts."""

    kind = ModelKind.synthetic
    length_buckets = True

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.started = threading.Event()

    def warmup(self) -> None:
        """Nothing to warm."""

    def run(self, inputs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        self.batches.append([item["text"] for item in inputs])
        self.started.set()
        time.sleep(1.0)
        return [{"echo": dict(item)} for item in inputs]


async def test_a_worker_that_stalled_gives_up_the_waiting_entries_another_worker_took_over(
    aredis: aioredis.Redis,
) -> None:
    model = unique("stalled")
    handler = SlowRecorder()
    worker = Worker(
        redis=aredis,
        model=model,
        version="v1",
        handler=handler,
        max_batch_size=2,
        max_wait_ms=0,
        claim_after_s=0.6,
        max_deliveries=3,
        shutdown_grace_s=5,
        name="stalled",
    )
    thief = consumer(aredis, model, "thief")
    texts = [f"job number {i}" for i in range(6)]
    ids = await queue_in_redis(aredis, model, [{"text": text} for text in texts])
    text_of = dict(zip(ids, texts, strict=True))
    run = asyncio.create_task(worker.run())
    try:
        assert await asyncio.to_thread(handler.started.wait, 10)
        # While its first batch runs, the other four entries wait in its batcher; as if it had
        # stalled past claim_after_s, another worker takes them over and keeps them fresh.
        stream = keys.stream(model, "v1", "online")
        waiting = [
            entry_id.decode()
            for entry_id, fields in await aredis.xrange(stream)
            if text_of[fields[b"id"].decode()] not in handler.batches[0]
        ]
        assert len(waiting) == 4, waiting
        await aredis.xclaim(stream, keys.GROUP, "thief", 0, waiting)
        for _ in range(20):  # 2 s: the first batch ends and the worker looks for more
            assert await thief.refresh({"online": waiting}) == set()
            await asyncio.sleep(0.1)
    finally:
        worker.request_stop()
        await asyncio.wait_for(run, timeout=10)

    assert handler.batches == [texts[:2]], handler.batches
    for entry_id in waiting:
        owner = await pending_entry(aredis, model, entry_id)
        assert owner is not None and owner["consumer"] == b"thief", owner
