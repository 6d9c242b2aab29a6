"""Admission on real Redis. Load shedding under concurrency: a burst of submissions that all read
the same backlog snapshot must still admit only what the latency budget allows. Over HTTP: which
lane a bulk submission takes, the tenant's quota under concurrency and expiry, and which refusals
spend the tenant's rate tokens (none)."""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import httpx
import pytest
import redis

from api.admission import Admission
from sluice.errors import TooManyRequests
from sluice.routing import VersionInfo
from sluice.settings import Settings
from sluice.wire import connections, heartbeats, keys
from sluice.wire.broker import Broker
from sluice.wire.entries import StreamEntry
from sluice.wire.heartbeats import Heartbeat, WorkerState
from sluice.wire.jobs import JobRecord, JobStatus
from sluice.wire.keys import new_job_id
from sluice.wire.quota import TenantLimits
from tests.support import MAX_BULK_ITEMS, ApiServer, claim_one, http_client, lane_jobs, serving, unique, wait_until


def _serving(*, items_per_s: float) -> Heartbeat:
    return Heartbeat(state=WorkerState.ready, items_per_s=items_per_s, batch_size=1, cold_start_s=0.0, processed=0,
                     pid=1, at=time.time())


def test_a_concurrent_burst_admits_only_what_the_budget_allows(redis_url: str) -> None:
    model = unique("admit")
    version = VersionInfo(model=model, version="v1", state="stable", artifact="synthetic:", sha256="0" * 64,
                          latency_budget_ms=1000.0)

    async def burst() -> int:
        client = connections.connect(redis_url)
        try:
            # One live worker serving 10 jobs/s and an empty backlog: a 1 s budget holds 10 jobs.
            await heartbeats.beat(client, model, "v1", "w1", _serving(items_per_s=10.0))
            admission = Admission(redis=client, broker=Broker(redis=client, result_ttl_s=60), max_answered_jobs=1000)

            async def one() -> bool:
                try:
                    await admission.shed(version, lane="online", count=1)
                    return True
                except TooManyRequests:
                    return False

            return sum(await asyncio.gather(*[one() for _ in range(50)]))
        finally:
            await client.aclose()

    assert asyncio.run(burst()) == 10


def test_jobs_admitted_but_not_yet_in_the_stream_count_against_the_budget(redis_url: str) -> None:
    model = unique("admit")
    version = VersionInfo(model=model, version="v1", state="stable", artifact="synthetic:", sha256="0" * 64,
                          latency_budget_ms=1000.0)

    async def admitted_before_refusal() -> tuple[int, bool]:
        client = connections.connect(redis_url)
        try:
            await heartbeats.beat(client, model, "v1", "w1", _serving(items_per_s=10.0))
            # No load cache: every admission reads the backlog, which never shows these jobs.
            admission = Admission(redis=client, broker=Broker(redis=client, result_ttl_s=60), max_answered_jobs=1000,
                                  load_cache_s=0.0)
            admitted = 0
            while admitted < 50:
                try:
                    await admission.shed(version, lane="online", count=1)
                except TooManyRequests:
                    break
                admitted += 1
            admission.written(version, lane="online", count=admitted)
            # Written, and still not in the stream (nothing was XADDed): the budget is free again.
            await admission.shed(version, lane="online", count=1)
            return admitted, True
        finally:
            await client.aclose()

    assert asyncio.run(admitted_before_refusal()) == (10, True)


def test_jobs_refused_after_shedding_admitted_them_give_their_place_back(redis_url: str) -> None:
    model = unique("admit")
    version = VersionInfo(model=model, version="v1", state="stable", artifact="synthetic:", sha256="0" * 64,
                          latency_budget_ms=1000.0)

    async def admitted_twice() -> tuple[int, int]:
        client = connections.connect(redis_url)
        try:
            await heartbeats.beat(client, model, "v1", "w1", _serving(items_per_s=10.0))
            # One backlog read for the whole test: only the in-process counts change.
            admission = Admission(redis=client, broker=Broker(redis=client, result_ttl_s=60), max_answered_jobs=1000,
                                  load_cache_s=60.0)

            async def fill() -> int:
                admitted = 0
                while admitted < 50:
                    try:
                        await admission.shed(version, lane="online", count=1)
                    except TooManyRequests:
                        return admitted
                    admitted += 1
                return admitted

            first = await fill()
            # The tenant's quota or rate refused them in the enqueue script: nothing reached the stream.
            admission.written(version, lane="online", count=first, queued=False)
            return first, await fill()
        finally:
            await client.aclose()

    assert asyncio.run(admitted_twice()) == (10, 10)

def test_a_burst_that_finds_the_load_stale_shares_one_read(redis_url: str) -> None:
    """Each submission that found the cached load stale used to read the backlog itself: a burst
    made one read per request instead of one per `load_cache_s`."""
    model = unique("admit")

    async def burst() -> list[object]:
        client = connections.connect(redis_url)
        try:
            await heartbeats.beat(client, model, "v1", "w1", _serving(items_per_s=10.0))
            admission = Admission(redis=client, broker=Broker(redis=client, result_ttl_s=60), max_answered_jobs=1000)
            return list(await asyncio.gather(*[admission.load(model, "v1") for _ in range(20)]))
        finally:
            await client.aclose()

    loads = asyncio.run(burst())
    assert len({id(load) for load in loads}) == 1
    assert loads[0].live_workers == 1  # type: ignore[attr-defined]


def _ask_for_a_fresh_read_as_the_last_one_finishes(redis_url: str, model: str) -> None:
    now = [100.0]

    async def race() -> None:
        client = connections.connect(redis_url)
        try:
            admission = Admission(redis=client, broker=Broker(redis=client, result_ttl_s=60), max_answered_jobs=1000,
                                  clock=lambda: now[0])
            first = asyncio.create_task(admission.load(model, "v1"))
            while not admission._reading:  # noqa: ASYNC110 - one step per loop turn is the point
                await asyncio.sleep(0)
            reading, _ = admission._reading[(model, "v1")]
            now[0] = 101.0  # this submission arrived after that read began
            # Woken once per loop turn, this step runs after the read's last step and before its
            # done callbacks, which run a turn later.
            while not reading.done():  # noqa: ASYNC110
                await asyncio.sleep(0)
            fresh = await admission.load(model, "v1", newer_than=101.0)
            assert ((await first).read_at, fresh.read_at) == (100.0, 101.0)
        finally:
            await client.aclose()

    asyncio.run(race())


def test_a_fresh_read_asked_for_just_as_the_last_one_finished_starts_another(redis_url: str) -> None:
    """A submission near the budget that asked for a read newer than its arrival in the instant after
    the read under way finished (its bookkeeping not yet run) waited on that finished read again and
    again without ever yielding: the API's event loop spun forever and every request hung. In a
    process of its own, so that a spinning loop can be killed."""
    process = multiprocessing.get_context("spawn").Process(
        target=_ask_for_a_fresh_read_as_the_last_one_finishes, args=(redis_url, unique("admit")))
    process.start()
    process.join(timeout=30)
    if process.is_alive():
        process.kill()
        process.join()
        pytest.fail("the admission read spun without yielding")
    assert process.exitcode == 0


def test_the_enqueue_script_writes_every_record_and_entry_as_their_codecs_say(rds: redis.Redis,
                                                                               redis_url: str) -> None:
    """The script is sent the fields a submission's jobs share once, and each job's own (id, input,
    cost, shadow copy...): what it writes must still be each job's whole record and entry."""
    model = unique("enqueue")
    now = time.time()
    tenant = unique("acme")
    records = [JobRecord(id=new_job_id(model, "v1"), tenant=tenant, model=model, version="v1", lane="bulk",
                         status=JobStatus.queued, input={"text": f"text {i}"}, cost=10 + i % 2, enqueued_at=now,
                         callback_url="https://example.com/hook", deadline=now + 60, metadata={"batch": 7},
                         shadow="v2" if i % 3 == 0 else None)
               for i in range(7)]
    limits = TenantLimits(tenant=tenant, rate_per_s=1000.0, burst=1000, max_queued=1000, max_answered=1000)

    async def enqueue(batch: list[JobRecord]) -> None:
        client = connections.connect(redis_url)
        try:
            assert await Broker(redis=client, result_ttl_s=60).enqueue(batch, limits=limits) is None
        finally:
            await client.aclose()

    asyncio.run(enqueue(records[:1]))
    asyncio.run(enqueue(records[1:]))

    # The script numbers the lane's jobs in the order it writes them (the job's place in its lane).
    numbered = [replace(record, seq=number) for number, record in enumerate(records, start=1)]
    for record in numbered:
        assert rds.hgetall(keys.job(record.id)) == {**record.to_redis(), "seq": str(record.seq)}
        assert JobRecord.from_redis(rds.hgetall(keys.job(record.id))).seq == record.seq
    entries = rds.xrange(keys.stream(model, "v1", "bulk"))
    assert [fields for _, fields in entries] == [StreamEntry.of(record).to_fields() for record in numbered]
    assert rds.zscore(keys.queue_added(model, "v1"), keys.stream(model, "v1", "bulk")) == len(records)
    assert set(rds.zrange(keys.queued_jobs(tenant), 0, -1)) >= {record.id for record in records}


# --- over HTTP: lanes, the tenant's quota and its rate tokens -------------------------------------

# What one warm MiniLM worker serves on this 2-core machine (71.9 texts/s in process):
# an idle platform, as admission sees it, is one live worker reporting this rate and no backlog.
MINILM_ITEMS_PER_S = 72.0


def _live_worker(redis_url: str, model: str, *, items_per_s: float, version: str = "v1") -> None:
    """A heartbeat as a warm, idle worker of `model` writes it (live for heartbeats.LIVE_WITHIN_S)."""

    async def beat() -> None:
        client = connections.connect(redis_url)
        try:
            await heartbeats.beat(client, model, version, unique("w"), _serving(items_per_s=items_per_s))
        finally:
            await client.aclose()

    asyncio.run(beat())


def _tenant(admin: httpx.Client, client_for: Callable[[str], httpx.Client], **limits: Any) -> tuple[str, httpx.Client]:
    response = admin.post("/v1/tenants", json={"id": unique("adm"), **limits})
    assert response.status_code == 201, response.text
    return response.json()["id"], client_for(response.json()["key"]["secret"])


def test_a_bulk_of_300_texts_on_an_idle_platform_is_accepted_on_the_bulk_lane(
    redis_url: str, rds: redis.Redis, admin: httpx.Client, client_for: Callable[[str], httpx.Client],
    register_synthetic: Callable[..., str],
) -> None:
    model = register_synthetic("bulk300")
    _live_worker(redis_url, model, items_per_s=MINILM_ITEMS_PER_S)
    _, client = _tenant(admin, client_for)
    texts = [{"text": f"an ordinary sentence to embed, number {i}"} for i in range(300)]

    response = client.post(f"/v1/models/{model}/jobs:bulk", json={"inputs": texts})

    assert response.status_code == 202, response.text
    assert response.json()["count"] == 300
    assert lane_jobs(rds, model, "v1", "bulk") == 300
    assert lane_jobs(rds, model, "v1", "online") == 0
    assert client.get(f"/v1/jobs/{response.json()['ids'][0]}").json()["lane"] == "bulk"


def test_an_online_submission_over_the_budget_is_told_to_use_the_bulk_lane(
    redis_url: str, rds: redis.Redis, admin: httpx.Client, client_for: Callable[[str], httpx.Client],
    register_synthetic: Callable[..., str],
) -> None:
    model = register_synthetic("online300")
    _live_worker(redis_url, model, items_per_s=MINILM_ITEMS_PER_S)
    _, client = _tenant(admin, client_for)
    texts = [{"text": f"an ordinary sentence to embed, number {i}"} for i in range(300)]

    response = client.post(f"/v1/models/{model}/jobs:bulk", json={"inputs": texts, "lane": "online"})

    assert response.status_code == 429, response.text
    assert response.headers["Retry-After"].isdigit()
    error = response.json()["error"]
    assert error["code"] == "too_many_requests"
    assert error["retry_with"] == {"lane": "bulk"}
    assert "bulk lane" in error["message"]
    assert lane_jobs(rds, model, "v1", "online") == 0


def test_the_schema_documents_the_lane_defaults_and_the_bulk_lane_hint(anon: httpx.Client) -> None:
    spec = anon.get("/openapi.json").json()
    schemas = spec["components"]["schemas"]
    assert schemas["SubmitBulk"]["properties"]["lane"]["default"] == "bulk"
    assert schemas["SubmitJob"]["properties"]["lane"]["default"] == "online"
    for path in ("/v1/models/{model}/jobs", "/v1/models/{model}/jobs:bulk"):
        refused = spec["paths"][path]["post"]["responses"]["429"]
        assert refused["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResource"}
    assert "retry_with" in schemas["ErrorDetail"]["properties"]

def test_concurrent_submissions_at_the_quota_boundary_never_exceed_it(
    api: Any, rds: redis.Redis, admin: httpx.Client, client_for: Callable[[str], httpx.Client],
    register_synthetic: Callable[..., str],
) -> None:
    model = register_synthetic("quota-race")  # no worker: every accepted job stays queued
    _, client = _tenant(admin, client_for, max_queued=10)
    key = client.headers["Authorization"]

    async def burst(n: int) -> list[int]:
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        async with httpx.AsyncClient(base_url=api.url, headers={"Authorization": key}, limits=limits,
                                     timeout=60.0) as session:
            responses = await asyncio.gather(*(session.post(f"/v1/models/{model}/jobs",
                                                            json={"input": {"text": f"race {i}"}})
                                               for i in range(n)))
        return [r.status_code for r in responses]

    codes = asyncio.run(burst(40))
    assert sorted(set(codes)) == [202, 429], codes
    assert codes.count(202) == 10, codes
    assert lane_jobs(rds, model, "v1", "online") == 10


@pytest.fixture(scope="module")
def short_lived_api(settings: Settings) -> Iterator[ApiServer]:
    """A second API replica whose job records expire after 2 s (the minimum setting is 60 s, so the
    copy skips validation on purpose)."""
    with serving(settings.model_copy(update={"result_ttl_s": 2})) as server:
        yield server


def test_a_job_whose_record_expired_unclaimed_frees_its_quota_place(
    short_lived_api: ApiServer, rds: redis.Redis, admin: httpx.Client, register_synthetic: Callable[..., str],
) -> None:
    model = register_synthetic("quota-expiry")  # no worker: the job is never claimed
    tenant = admin.post("/v1/tenants", json={"id": unique("adm"), "max_queued": 1}).json()
    with http_client(short_lived_api.url, tenant["key"]["secret"]) as client:
        first = client.post(f"/v1/models/{model}/jobs", json={"input": {"text": "forgotten"}})
        assert first.status_code == 202, first.text
        assert client.post(f"/v1/models/{model}/jobs", json={"input": {"text": "full"}}).status_code == 429
        wait_until(lambda: not rds.exists(keys.job(first.json()["id"])), timeout_s=10, what="the record to expire")

        again = client.post(f"/v1/models/{model}/jobs", json={"input": {"text": "room again"}})
        assert again.status_code == 202, again.text


def test_a_shed_submission_spends_none_of_the_tenants_rate_tokens(
    redis_url: str, rds: redis.Redis, admin: httpx.Client, client_for: Callable[[str], httpx.Client],
    register_synthetic: Callable[..., str],
) -> None:
    model = register_synthetic("shed-tokens")
    # One job a second and a 2 s budget: the third queued online job would wait past it.
    _live_worker(redis_url, model, items_per_s=1.0)
    tenant, client = _tenant(admin, client_for, rate_limit_per_s=1)
    for i in range(2):
        response = client.post(f"/v1/models/{model}/jobs", json={"input": {"text": f"fits {i}"}})
        assert response.status_code == 202, response.text
    bucket = rds.hgetall(keys.rate_bucket(tenant))

    shed = client.post(f"/v1/models/{model}/jobs", json={"input": {"text": "one too many"}})

    assert shed.status_code == 429 and "overloaded" in shed.json()["error"]["message"], shed.text
    assert rds.hgetall(keys.rate_bucket(tenant)) == bucket


def test_a_submission_over_the_quota_spends_none_of_the_tenants_rate_tokens(
    rds: redis.Redis, admin: httpx.Client, client_for: Callable[[str], httpx.Client],
    register_synthetic: Callable[..., str],
) -> None:
    model = register_synthetic("quota-tokens")
    tenant, client = _tenant(admin, client_for, rate_limit_per_s=1, max_queued=1)
    assert client.post(f"/v1/models/{model}/jobs", json={"input": {"text": "fits"}}).status_code == 202
    bucket = rds.hgetall(keys.rate_bucket(tenant))

    refused = client.post(f"/v1/models/{model}/jobs", json={"input": {"text": "over quota"}})

    assert refused.status_code == 429 and "quota" in refused.json()["error"]["message"], refused.text
    assert rds.hgetall(keys.rate_bucket(tenant)) == bucket


def test_a_claimed_or_cancelled_job_leaves_the_quota(
    rds: redis.Redis, admin: httpx.Client, client_for: Callable[[str], httpx.Client],
    register_synthetic: Callable[..., str],
) -> None:
    model = register_synthetic("quota-leave")
    tenant, client = _tenant(admin, client_for, max_queued=1)
    claimed = client.post(f"/v1/models/{model}/jobs", json={"input": {"text": "claimed"}}).json()["id"]
    assert rds.zrange(keys.queued_jobs(tenant), 0, -1) == [claimed]
    # What a worker's claim does (StreamConsumer.claim): queued -> running.
    verdict = claim_one(rds, model, claimed, tenant)
    assert verdict[0] == "run"
    assert rds.zcard(keys.queued_jobs(tenant)) == 0

    cancelled = client.post(f"/v1/models/{model}/jobs", json={"input": {"text": "cancelled"}})
    assert cancelled.status_code == 202, cancelled.text
    assert client.delete(f"/v1/jobs/{cancelled.json()['id']}").status_code == 200
    assert rds.zcard(keys.queued_jobs(tenant)) == 0
    assert client.post(f"/v1/models/{model}/jobs", json={"input": {"text": "room"}}).status_code == 202


@pytest.mark.soak
def test_a_bulk_larger_than_the_burst_leaves_debt_that_no_expiry_forgives(
    rds: redis.Redis, admin: httpx.Client, client_for: Callable[[str], httpx.Client],
    register_synthetic: Callable[..., str],
) -> None:
    """One job a second, a burst of 10. A bulk larger than the burst used to pass on a bucket sized
    to it; a single job then renewed the bucket for the 10 tokens of the burst only, so the bucket
    expired 11 s later and the next bulk found a full one again: 1,000 jobs in 13 s."""
    model = register_synthetic("bulk-debt")  # no worker: nothing but admission matters
    tenant, client = _tenant(admin, client_for, rate_limit_per_s=1)
    bulk = {"inputs": [{"text": f"row {i}"} for i in range(MAX_BULK_ITEMS)]}

    codes = [client.post(f"/v1/models/{model}/jobs:bulk", json=bulk).status_code]
    time.sleep(1.1)
    codes.append(client.post(f"/v1/models/{model}/jobs", json={"input": {"text": "one"}}).status_code)
    time.sleep(12)
    again = client.post(f"/v1/models/{model}/jobs:bulk", json=bulk)
    codes.append(again.status_code)

    assert codes == [202, 429, 429], codes
    assert int(again.headers["Retry-After"]) > MAX_BULK_ITEMS - 30, again.headers
    assert rds.zcard(keys.queued_jobs(tenant)) == MAX_BULK_ITEMS
