"""Jobs answered from the response cache are admitted like the others, over the real API, Redis and
`sluice worker` (ARCHITECTURE, "Admission"): a hit spends rate tokens (`cache_hit_token_cost`),
must fit under the tenant's quota, and counts toward the bound on its stored answered jobs
(`max_answered_jobs`). A bulk larger than the tenant's burst leaves debt in its bucket, so that
no loop of bulk submissions, cached or not, goes faster than the tenant's rate.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from sluice.settings import Settings
from sluice.wire import connections, keys, response_cache
from sluice.wire.broker import Broker
from sluice.wire.jobs import JobRecord, JobStatus
from sluice.wire.quota import TenantLimits
from tests.support import (
    FAST_SYNTHETIC,
    MAX_BULK_ITEMS,
    SYNTHETIC_SHA,
    ApiServer,
    http_client,
    serving,
    spawn_worker,
    unique,
    wait_job,
)

TTL_S = 300
STORED_BOUND = 5


@pytest.fixture(scope="module")
def cached(admin: httpx.Client, api: Any, redis_url: str, database_url: str, home: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A synthetic model whose v1 caches answers for TTL_S and has a worker; v2 has no worker."""
    name = unique("cache-admit")
    assert admin.post("/v1/models", json={"name": name, "kind": "synthetic"}).status_code == 201
    for version in ("v1", "v2"):
        response = admin.post(f"/v1/models/{name}/versions", json={
            "version": version, "artifact": f"synthetic:?{FAST_SYNTHETIC}", "sha256": SYNTHETIC_SHA,
            "state": "stable", "batching": {"max_wait_ms": 5.0}, "cache_ttl_s": TTL_S})
        assert response.status_code == 201, response.text
    assert admin.put(f"/v1/models/{name}/routing", json={"weights": {"v1": 100.0}}).status_code == 200
    worker = spawn_worker(redis_url=redis_url, database_url=database_url, home=home, model=name,
                          log_path=tmp_path_factory.mktemp("worker") / "worker.log")
    yield name
    assert worker.terminate() == 0, worker.log()


def _tenant(admin: httpx.Client, **limits: float) -> dict[str, Any]:
    response = admin.post("/v1/tenants", json={"id": unique("cache-admit"), **limits})
    assert response.status_code == 201, response.text
    body: dict[str, Any] = response.json()
    return body


def _ran(client: httpx.Client, model: str, text: str) -> None:
    """Run `text` once through the worker, so that the tenant's next submissions of it are hits."""
    response = client.post(f"/v1/models/{model}/jobs", json={"input": {"text": text}})
    assert response.status_code == 202, response.text
    job = wait_job(client, response.json()["id"])
    assert job["status"] == "succeeded" and job["cache_hit"] is False, job


def _hit(client: httpx.Client, model: str, text: str) -> httpx.Response:
    return client.post(f"/v1/models/{model}/jobs", json={"input": {"text": text}})


def test_a_loop_of_bulk_submissions_of_cached_inputs_is_held_to_the_tenants_rate(
    cached: str, admin: httpx.Client, client_for: Callable[[str], httpx.Client], rds: redis.Redis,
) -> None:
    """One job a second (a burst of 10): every bulk of identical cached inputs used to pass, none of
    them spending a token. Now the first bulk, larger than the burst, takes the whole bucket and
    leaves the rest as debt: the next one waits until it is paid."""
    tenant = _tenant(admin, rate_limit_per_s=1)
    client = client_for(tenant["key"]["secret"])
    _ran(client, cached, "the same input")
    time.sleep(1.0)  # the token that job spent is back: a bulk larger than the burst needs a full bucket
    bulk = {"inputs": [{"text": "the same input"}] * MAX_BULK_ITEMS}

    codes = []
    for _ in range(5):
        response = client.post(f"/v1/models/{cached}/jobs:bulk", json=bulk)
        codes.append(response.status_code)
        if response.status_code == 429:
            break
        assert client.get(f"/v1/jobs/{response.json()['ids'][-1]}").json()["cache_hit"] is True

    assert codes == [202, 429], codes
    error = response.json()["error"]
    assert error["code"] == "too_many_requests" and "rate limit" in error["message"], error
    # The debt: about MAX_BULK_ITEMS - 10 seconds of refill at one token a second.
    assert int(response.headers["Retry-After"]) > MAX_BULK_ITEMS - 20, response.headers
    assert _hit(client, cached, "the same input").status_code == 429
    assert float(rds.hget(keys.rate_bucket(tenant["id"]), "tokens")) < 0  # type: ignore[arg-type]


def test_a_tenant_at_its_quota_is_refused_hits_too(
    cached: str, admin: httpx.Client, client_for: Callable[[str], httpx.Client], rds: redis.Redis,
) -> None:
    tenant = _tenant(admin, max_queued=2)
    client = client_for(tenant["key"]["secret"])
    _ran(client, cached, "answered before")
    # Two jobs for v2, which has no worker: the tenant's queue is full.
    for i in range(2):
        held = client.post(f"/v1/models/{cached}/jobs", json={"input": {"text": f"held {i}"}, "version": "v2"})
        assert held.status_code == 202, held.text

    refused = _hit(client, cached, "answered before")

    assert refused.status_code == 429 and "quota" in refused.json()["error"]["message"], refused.text
    assert rds.zcard(keys.answered_jobs(tenant["id"])) == 0


def test_a_bulk_of_hits_larger_than_the_quota_is_refused_whole(
    cached: str, admin: httpx.Client, client_for: Callable[[str], httpx.Client],
) -> None:
    tenant = _tenant(admin, max_queued=3)
    client = client_for(tenant["key"]["secret"])
    _ran(client, cached, "answered before")

    over = client.post(f"/v1/models/{cached}/jobs:bulk", json={"inputs": [{"text": "answered before"}] * 4})
    assert over.status_code == 429 and "quota" in over.json()["error"]["message"], over.text
    # A hit holds no place once answered: a bulk that fits passes again and again.
    for _ in range(2):
        fits = client.post(f"/v1/models/{cached}/jobs:bulk", json={"inputs": [{"text": "answered before"}] * 3})
        assert fits.status_code == 202, fits.text


@pytest.fixture(scope="module")
def bounded_api(settings: Settings, api: Any) -> Iterator[ApiServer]:
    """A second API replica that lets a tenant store at most STORED_BOUND answered jobs."""
    with serving(settings.model_copy(update={"max_answered_jobs": STORED_BOUND})) as server:
        yield server


def test_answered_jobs_a_tenant_stores_are_bounded(
    cached: str, bounded_api: ApiServer, admin: httpx.Client, rds: redis.Redis,
) -> None:
    tenant = _tenant(admin)
    with http_client(bounded_api.url, tenant["key"]["secret"]) as client:
        _ran(client, cached, "stored answer")
        for _ in range(STORED_BOUND):
            response = _hit(client, cached, "stored answer")
            assert response.status_code == 202 and response.json()["cache_hit"] is True, response.text
        bucket = rds.hgetall(keys.rate_bucket(tenant["id"]))

        refused = _hit(client, cached, "stored answer")
        over = client.post(f"/v1/models/{cached}/jobs:bulk", json={"inputs": [{"text": "stored answer"}] * 2})

        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "stored_jobs_limit", refused.text
        assert 0 < int(refused.headers["Retry-After"]) <= 24 * 3600
        assert over.status_code == 429 and over.json()["error"]["code"] == "stored_jobs_limit", over.text
        # A refusal charges nothing; a job that runs is no stored answer and still passes.
        assert rds.hgetall(keys.rate_bucket(tenant["id"])) == bucket
        assert client.post(f"/v1/models/{cached}/jobs", json={"input": {"text": "new"}}).status_code == 202
    assert rds.zcard(keys.answered_jobs(tenant["id"])) == STORED_BOUND


def test_another_tenants_stored_answers_do_not_count(
    cached: str, bounded_api: ApiServer, admin: httpx.Client,
) -> None:
    first, second = _tenant(admin), _tenant(admin)
    with http_client(bounded_api.url, first["key"]["secret"]) as one, \
            http_client(bounded_api.url, second["key"]["secret"]) as other:
        _ran(one, cached, "mine")
        _ran(other, cached, "mine")
        for _ in range(STORED_BOUND):
            assert _hit(one, cached, "mine").status_code == 202
        assert _hit(one, cached, "mine").status_code == 429
        response = _hit(other, cached, "mine")
        assert response.status_code == 202 and response.json()["cache_hit"] is True, response.text


def test_a_hit_spends_the_configured_share_of_a_token(redis_url: str, rds: redis.Redis) -> None:
    """`cache_hit_token_cost` below 1: four hits spend one token, and each takes its place among the
    stored answers until its record expires."""
    model, tenant, now = unique("hit-cost"), unique("hit-cost"), time.time()
    hits = [response_cache.answered(JobRecord(
        id=keys.new_job_id(model, "v1"), tenant=tenant, model=model, version="v1", lane="online",
        status=JobStatus.queued, input={"text": "same"}, cost=1, enqueued_at=now), b'{"echo": 1}', at=now)
        for _ in range(4)]
    limits = TenantLimits(tenant=tenant, rate_per_s=0.001, burst=10, max_queued=10, max_answered=10, hit_cost=0.25)

    async def enqueue() -> None:
        client = connections.connect(redis_url)
        try:
            assert await Broker(redis=client, result_ttl_s=60).enqueue(hits, limits=limits) is None
        finally:
            await client.aclose()

    asyncio.run(enqueue())

    assert float(rds.hget(keys.rate_bucket(tenant), "tokens")) == pytest.approx(9.0, abs=0.01)  # type: ignore[arg-type]
    assert rds.zcard(keys.answered_jobs(tenant)) == len(hits)
    assert [rds.zscore(keys.answered_jobs(tenant), hit.id) for hit in hits] == [pytest.approx(now + 60)] * len(hits)
