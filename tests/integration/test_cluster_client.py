"""The protocol on a real Redis Cluster, fast (the whole job path on one is tests/faults/test_redis_cluster.py):
the setting that selects the cluster client, the scripts' keys in one slot while a submission's
version and tenant live on different nodes, and job events across nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from redis.crc import key_slot

from sluice.registry.store import Registry
from sluice.settings import Settings
from sluice.wire import events, keys, scripts
from sluice.wire.broker import Broker
from sluice.wire.connections import connect, connect_sync
from sluice.wire.idempotency import IdempotencyClaim
from sluice.wire.jobs import JobRecord, JobStatus
from sluice.wire.quota import Refusal, TenantLimits
from sluice.wire.samples import Sample
from sluice.wire.script_calls import Finished
from sluice.wire.streams import StreamConsumer
from tests.redis_cluster import LocalCluster, running_cluster
from tests.support import claim_one, finish_one_call, lane_jobs_async, queue_in_redis, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with running_cluster(tmp_path_factory.mktemp("cluster")) as made:
        yield made


@pytest.fixture
async def client(cluster: LocalCluster) -> AsyncIterator[aioredis.Redis]:
    made = connect(cluster.url)
    yield made
    await made.aclose()


def _apart(cluster: LocalCluster) -> tuple[str, str]:
    """A model and a tenant whose keys live on different nodes: a script that touched both would fail."""
    for n in range(100):
        model, tenant = f"apart-{n}", f"tenant-{n}"
        if cluster.node_of(keys.stream(model, "v1", "online")) != cluster.node_of(keys.queued_jobs(tenant)):
            return model, tenant
    raise AssertionError("no model and tenant on different nodes")


def test_the_setting_or_the_scheme_selects_the_cluster_client(cluster: LocalCluster) -> None:
    plain = cluster.url.replace("redis+cluster://", "redis://")
    settings = Settings(redis_url=plain, redis_cluster=True)
    assert settings.require_redis_url() == cluster.url
    with connect_sync(settings.require_redis_url()) as client:
        assert isinstance(client, redis.RedisCluster)
        assert len(client.get_primaries()) == 3
    with pytest.raises(ValueError, match="SLUICE_CELERY_BROKER_URL"):
        settings.require_celery_broker_url()


def test_the_cluster_refuses_a_script_across_slots(cluster: LocalCluster) -> None:
    """What every Sluice script must avoid, and what this cluster catches (sent to a node straight:
    the cluster client refuses it before sending)."""
    node = cluster.nodes[0]
    with redis.Redis(host="127.0.0.1", port=node.port) as client, \
            pytest.raises(redis.exceptions.ResponseError, match="same slot"):
        client.eval("return 1", 2, "{a}x", "{b}y")


async def test_a_submission_is_admitted_written_claimed_and_finished_across_nodes(
    cluster: LocalCluster, client: aioredis.Redis,
) -> None:
    model, tenant = _apart(cluster)
    broker = Broker(redis=client, result_ttl_s=600)
    consumer = StreamConsumer(redis=client, model=model, version="v1", name="w1", claim_after_s=30.0,
                              max_deliveries=3, result_ttl_s=600)
    await consumer.ensure_groups()
    now = time.time()
    records = [JobRecord(id=keys.new_job_id(model, "v1"), tenant=tenant, model=model, version="v1", lane="online",
                         status=JobStatus.queued, input={"text": f"t{i}"}, enqueued_at=now, cost=1,
                         callback_url="https://hooks.example.com/x") for i in range(3)]
    claim = await broker.claim_idempotency_key(tenant, "key-1", "hash-1")
    limits = TenantLimits(tenant=tenant, rate_per_s=100.0, burst=100, max_queued=4, max_answered=100)
    assert await broker.enqueue(records, limits=limits, idempotency=claim) is None
    assert await client.zcard(keys.queued_jobs(tenant)) == 3
    replay = await broker.claim_idempotency_key(tenant, "key-1", "hash-1")
    assert replay.replay == [r.id for r in records]
    # Two more would pass the quota of four: refused, with nothing written.
    more = [JobRecord(id=keys.new_job_id(model, "v1"), tenant=tenant, model=model, version="v1", lane="online",
                      status=JobStatus.queued, input={"text": "x"}, enqueued_at=now) for _ in range(2)]
    assert await broker.enqueue(more, limits=limits) == Refusal("quota", queued=3)
    assert await lane_jobs_async(client, model, "v1", "online") == 3

    delivered = await consumer.read(["online"], count=10, block_ms=None)
    claims = await consumer.claim(delivered, now=time.time())
    assert [c.verdict for c in claims] == ["run"] * 3
    assert await client.zcard(keys.queued_jobs(tenant)) == 0
    sample = Sample(status="succeeded", finished_at=now, queue_wait_ms=1.0, model_ms=1.0, total_ms=2.0, batch_size=3,
                    close_reason="size")
    won = await consumer.finish(
        [Finished(job_id=d.entry.job_id, lane=d.lane, entry_id=d.entry_id, status="succeeded",
                  output='{"echo":"ok"}', error="", sample=sample) for d in delivered],
        faults=[], started=now, finished=time.time(), model_ms=1.0, batch_size=3, close_reason="size")
    assert won == [True] * 3
    assert await client.xlen(keys.outbox(model, "v1")) == 3
    assert keys.outbox(model, "v1").encode() in await client.smembers(keys.WEBHOOK_OUTBOXES)
    got = await broker.get(records[0].id)
    assert got is not None and got.status is JobStatus.succeeded


async def test_a_cancel_frees_the_place_in_the_tenants_slot(cluster: LocalCluster, client: aioredis.Redis) -> None:
    model, tenant = _apart(cluster)
    broker = Broker(redis=client, result_ttl_s=600)
    record = JobRecord(id=keys.new_job_id(model, "v1"), tenant=tenant, model=model, version="v1", lane="bulk",
                       status=JobStatus.queued, input={"text": "cancel me"}, enqueued_at=time.time())
    limits = TenantLimits(tenant=tenant, rate_per_s=100.0, burst=100, max_queued=100, max_answered=100)
    assert await broker.enqueue([record], limits=limits) is None
    assert await broker.cancel(record) is None
    assert await broker.cancel(record) == "cancelled"
    assert await client.zscore(keys.queued_jobs(tenant), record.id) is None


async def test_job_events_reach_the_hub_that_waits_on_them_from_every_node(cluster: LocalCluster) -> None:
    """Each job's channel is of its slot: the scripts SPUBLISH it on the job's node, and a hub
    subscribes on that node only while it waits; a hub with no waiters hears nothing."""
    from api.event_hub import EventHub

    models: dict[int, str] = {}
    for n in range(200):
        models.setdefault(cluster.node_of(keys.stream(f"spread-{n}", "v1", "online")), f"spread-{n}")
    assert len(models) == 3
    waiting, idle = connect(cluster.url), connect(cluster.url)
    hubs = [EventHub(redis=waiting, on_control=lambda _: None), EventHub(redis=idle, on_control=lambda _: None)]
    listening = [asyncio.create_task(hub.run()) for hub in hubs]
    try:
        ids = {model: (await queue_in_redis(waiting, model, [{"text": model}]))[0] for model in models.values()}
        watch = await hubs[0].watch_final(ids.values())
        with connect_sync(cluster.url, decode_responses=True) as rds:
            for model, job_id in ids.items():
                assert claim_one(rds, model, job_id, "demo")[0] == "run"
                assert rds.eval(scripts.FINISH, *finish_one_call(rds, model, job_id, '{"ok":true}')) == [1]
        finished: set[str] = set()
        async with asyncio.timeout(10):
            while finished != set(ids.values()):
                await watch.event.wait()
                finished |= watch.take()
        assert hubs[0].jobs.received == 2 * len(ids)  # `running`, then `succeeded`
        assert hubs[1].jobs.received == 0
        hubs[0].unwatch_final(ids.values(), watch)
    finally:
        for task in listening:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await waiting.aclose()
        await idle.aclose()


async def test_a_watched_jobs_channel_follows_its_slot_to_another_node(tmp_path: Path) -> None:
    """When a slot moves, its node unsubscribes the slot's channels itself: the hub subscribes
    again on the new owner and wakes the job's waiters to re-read it, and the job's later events
    arrive from there."""
    from api.event_hub import EventHub

    with running_cluster(tmp_path / "cluster") as cluster:
        client = connect(cluster.url)
        hub = EventHub(redis=client, on_control=lambda _: None)
        listening = asyncio.create_task(hub.run())
        try:
            job_id = keys.new_job_id("moving", "v1")  # no record: its slot holds no key to migrate
            channel = events.job_channel(client, job_id)
            source = cluster.node_of(keys.job(job_id))
            target = (source + 1) % cluster.masters
            watch = await hub.watch_final((job_id,))
            _move_slot(cluster, key_slot(keys.job(job_id).encode()), source, target)
            await asyncio.wait_for(watch.event.wait(), timeout=20)
            assert watch.take() == set()  # woken by the gap, with no change named
            assert hub.jobs._where[channel].name.endswith(f":{cluster.nodes[target].port}")
            async with asyncio.timeout(20):
                while not watch.event.is_set():
                    await events.publish(client, events.JobChanged(id=job_id, status="succeeded"))
                    await asyncio.sleep(0.1)
            assert watch.take() == {job_id}
            hub.unwatch_final((job_id,), watch)
        finally:
            listening.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listening
            await client.aclose()


def _move_slot(cluster: LocalCluster, slot: int, source: int, target: int) -> None:
    """Hand an empty slot from one master to another, as `redis-cli --cluster reshard` would."""
    nodes = [redis.Redis(host="127.0.0.1", port=node.port, decode_responses=True) for node in cluster.nodes]
    try:
        ids = [node.execute_command("CLUSTER", "MYID") for node in nodes]
        nodes[target].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[source])
        nodes[source].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[target])
        for n in (target, source, *(n for n in range(len(nodes)) if n not in (source, target))):
            nodes[n].execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[target])
    finally:
        for node in nodes:
            node.close()


def test_an_idempotency_key_lives_in_its_tenants_slot() -> None:
    claim = IdempotencyClaim(keys.idempotency("acme", "f" * 64), "hash")
    assert key_slot(claim.redis_key.encode()) == key_slot(keys.rate_bucket("acme").encode())


@pytest.mark.soak  # a node stopped for 4 s and the cluster's recovery: about 10 s
def test_the_schedulers_event_listener_outlives_the_node_its_url_names(tmp_path: Path, registry: Registry) -> None:
    """Reconnecting while the named node is down raises the cluster client's own exception, which
    is not a RedisError: the listener must wait and retry, not end and leave the scheduler deaf."""
    from scheduler.main import Scheduler, autoscaler

    with running_cluster(tmp_path / "cluster") as cluster:
        scheduler = Scheduler(registry=registry, redis_url=cluster.url, supervisor=None,
                              autoscaler=autoscaler(Settings(worker_slots=2)))
        listener = threading.Thread(target=scheduler._listen, name="scheduler-events", daemon=True)
        listener.start()
        try:
            cluster.nodes[0].stop()
            time.sleep(4)
            assert listener.is_alive(), "the listener ended while the node was down"
            cluster.nodes[0].start()
            wait_until(cluster.ready, timeout_s=30, what="the cluster with its node back")
            routing = json.dumps({"type": "routing", "model": "any"})
            with connect_sync(cluster.url) as publisher:
                deadline = time.monotonic() + 20
                while not scheduler._wake.wait(0.2):
                    assert time.monotonic() < deadline, "no routing event reached the scheduler"
                    publisher.publish(events.channel(publisher), routing)
        finally:
            scheduler.request_stop()
            listener.join(timeout=10)
