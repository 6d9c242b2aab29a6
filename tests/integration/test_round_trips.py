"""A worker's Redis round trips per read and per batch, counted on the client's connection.

Each round trip costs the worker a send, a wait and a parse; on small batches they are most of its
CPU outside the model (bench/worker_cost.py). Claiming a read (with settling the entries that will
not run) is one on one server: the claim script in the version's slot and, in the same pipeline,
the quota places freed in the tenants' slots (two round trips on a cluster, where this module
skips). Storing a batch (outcomes, samples, events, faults, acks) is one, and one more
when it queues shadow copies (another version's slot). On a single server a submission, admitted
or refused, is one (`admit_queue.lua`).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from sluice.batcher import Batch, Item
from sluice.wire import keys, scripts
from sluice.wire.broker import Broker
from sluice.wire.connections import cluster_url
from sluice.wire.jobs import JobRecord, JobStatus
from sluice.wire.keys import new_job_id
from sluice.wire.quota import TenantLimits
from sluice.wire.streams import StreamConsumer
from tests.support import lane_jobs_async, queue_in_redis, unique
from workers.execution import Outcome
from workers.results import Delivery, ResultWriter


class CountingConnection(aioredis.Connection):
    """Counts what it sends: one send is one round trip (a pipeline is one send)."""

    sent = 0

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        CountingConnection.sent += 1
        await super().send_packed_command(command, check_health)


@pytest.fixture
async def counted(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    if cluster_url(redis_url) is not None:
        pytest.skip("counts the round trips of one connection: a cluster client keeps one per node")
    pool = aioredis.ConnectionPool.from_url(redis_url, connection_class=CountingConnection, max_connections=1)
    client = aioredis.Redis.from_pool(pool)
    await client.ping()  # the connection's hello and database selection are not the worker's
    # A server that does not know a script answers NOSCRIPT and the client loads it (two more
    # round trips, once per server): what is counted here is every call after that.
    await client.script_load(scripts.CLAIM)
    await client.script_load(scripts.FINISH)
    yield client
    await client.aclose()


async def round_trips(call: Any) -> tuple[Any, int]:
    before = CountingConnection.sent
    result = await call
    return result, CountingConnection.sent - before


async def test_claiming_a_read_and_storing_its_batch_are_one_round_trip_each(counted: aioredis.Redis) -> None:
    model = unique("trips")
    streams = StreamConsumer(
        redis=counted,
        model=model,
        version="v1",
        name="counted",
        claim_after_s=30.0,
        max_deliveries=3,
        result_ttl_s=3600,
    )
    await streams.ensure_groups()
    plain = await queue_in_redis(counted, model, [{"text": f"plain {i}"} for i in range(4)])
    copied = await queue_in_redis(counted, model, [{"text": f"copied {i}"} for i in range(3)], shadow="v2")
    cancelled = plain.pop()
    await counted.hset(keys.job(cancelled), "status", "cancelled")  # settled by the claim, not run
    delivered = await streams.read(["online"], count=100, block_ms=None)

    claims, trips = await round_trips(streams.claim(delivered, now=time.time()))
    assert trips == 1
    verdicts = {d.entry.job_id: c.verdict for d, c in zip(delivered, claims, strict=True)}
    assert verdicts == {**{job_id: "run" for job_id in plain + copied}, cancelled: "cancelled"}
    run = [(d, c) for d, c in zip(delivered, claims, strict=True) if c.verdict == "run"]
    batch = Batch(
        items=tuple(
            Item(
                id=d.entry_id,
                tenant=d.entry.tenant,
                cost=d.entry.cost,
                enqueued_at=d.entry.enqueued_at,
                payload=Delivery(
                    job_id=d.entry.job_id, lane=d.lane, input=c.input, attempts=c.attempts, shadow=d.entry.shadow
                ),
            )
            for d, c in run
        ),
        close_reason="size",
        bucket=0,
        tenant=None,
        closed_at=time.time(),
    )
    # Plain jobs: one succeeded, one failed for good, one whose run faulted (left for redelivery).
    outcomes = [
        Outcome(output={"echo": "ok"}),
        Outcome(error={"code": "inference_error", "message": "bad"}),
        Outcome(fault="RuntimeError: device lost"),
        *(Outcome(output={"echo": "copied"}) for _ in copied),
    ]
    assert [item.payload.job_id for item in batch.items] == plain + copied
    writer = ResultWriter(streams=streams, result_ttl_s=3600)

    won, trips = await round_trips(
        writer.store(batch, outcomes, started=time.time(), finished=time.time(), model_ms=1.0)
    )
    assert trips == 2
    assert won == [True, True, False, True, True, True]
    statuses = [await counted.hget(keys.job(job_id), "status") for job_id in plain + copied]
    assert statuses == [b"succeeded", b"failed", b"running", b"succeeded", b"succeeded", b"succeeded"]
    assert await counted.hget(keys.job(plain[2]), "last_error") == b"RuntimeError: device lost"
    assert await counted.xlen(keys.stats(model, "v1")) == 5
    copies = await counted.xrange(keys.stream(model, "v2", "bulk"))
    assert sorted(fields[b"so"].decode() for _, fields in copies) == sorted(copied)
    for _, fields in copies:
        record = await counted.hgetall(keys.job(fields[b"id"].decode()))
        assert record[b"status"] == b"queued" and json.loads(record[b"input"])["text"].startswith("copied")
    # Only the faulted job's entry is still pending; the others (and the settled one) are gone.
    pending = await counted.xpending_range(keys.stream(model, "v1", "online"), keys.GROUP, min="-", max="+", count=100)
    assert [p["message_id"].decode() for p in pending] == [batch.items[2].id]
    assert await lane_jobs_async(counted, model, "v1", "online") == 1


async def test_on_one_server_a_submission_is_admitted_and_written_in_one_round_trip(
    counted: aioredis.Redis, rds: redis.Redis
) -> None:
    model, tenant = unique("onestep"), unique("acme")
    limits = TenantLimits(tenant=tenant, rate_per_s=100.0, burst=100, max_queued=1, max_answered=10)

    def record(owner: str) -> JobRecord:
        return JobRecord(id=new_job_id(model, "v1"), tenant=owner, model=model, version="v1", lane="online",
                         status=JobStatus.queued, input={"text": "hello"}, cost=3, enqueued_at=time.time())

    queued, refused = record(tenant), record(tenant)
    broker = Broker(redis=counted, result_ttl_s=60)
    # Another tenant's submission first: the server then knows the script.
    other = unique("other")
    await broker.enqueue([record(other)], limits=replace(limits, tenant=other))
    accepted, sent = await round_trips(broker.enqueue([queued], limits=limits))
    assert accepted is None and sent == 1
    refusal, sent = await round_trips(broker.enqueue([refused], limits=limits))
    assert sent == 1
    assert refusal is not None and refusal.reason == "quota"
    assert rds.hgetall(keys.job(queued.id)) == {**queued.to_redis(), "seq": "2"}  # the lane's second job
    assert not rds.exists(keys.job(refused.id))
    stream = [fields["id"] for _, fields in rds.xrange(keys.stream(model, "v1", "online"))]
    assert queued.id in stream and refused.id not in stream


async def test_a_claim_on_a_server_that_lost_its_scripts_claims_and_frees_the_places(
    counted: aioredis.Redis,
) -> None:
    """The claim goes by the script's digest in the pipeline that frees the places: after a
    restart (or SCRIPT FLUSH) the server answers NOSCRIPT to it alone, and the claim runs again."""
    model, tenant = unique("noscript"), unique("acme")
    streams = StreamConsumer(redis=counted, model=model, version="v1", name="flushed", claim_after_s=30.0,
                             max_deliveries=3, result_ttl_s=3600)
    await streams.ensure_groups()
    job_ids = await queue_in_redis(counted, model, [{"text": f"job {i}"} for i in range(3)], tenant=tenant)
    await counted.zadd(keys.queued_jobs(tenant), dict.fromkeys(job_ids, time.time() + 3600))
    delivered = await streams.read(["online"], count=10, block_ms=None)
    await counted.script_flush()

    claims = await streams.claim(delivered, now=time.time())

    assert [claim.verdict for claim in claims] == ["run", "run", "run"]
    assert [await counted.hget(keys.job(job_id), "status") for job_id in job_ids] == [b"running"] * 3
    assert await counted.zcard(keys.queued_jobs(tenant)) == 0
    # Known again from then on: the next claim is one round trip.
    more = await queue_in_redis(counted, model, [{"text": "one more"}], tenant=tenant)
    delivered = await streams.read(["online"], count=10, block_ms=None)
    claims, trips = await round_trips(streams.claim(delivered, now=time.time()))
    assert [claim.verdict for claim in claims] == ["run"] and trips == 1
    assert await counted.hget(keys.job(more[0]), "status") == b"running"
