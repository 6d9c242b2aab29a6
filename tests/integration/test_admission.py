"""Admission on real Redis. Load shedding under concurrency: a burst of submissions that all read
the same backlog snapshot must still admit only what the latency budget allows. Over HTTP: which
lane a bulk submission takes, and what an online refusal tells the client to do instead."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx
import redis

from api.admission import Admission
from sluice import connections, heartbeats, keys
from sluice.errors import TooManyRequests
from sluice.heartbeats import Heartbeat, WorkerState
from sluice.registry.queries import KeyInfo
from sluice.routing import VersionInfo
from tests.support import unique


def _serving(*, items_per_s: float) -> Heartbeat:
    return Heartbeat(state=WorkerState.ready, items_per_s=items_per_s, batch_size=1, cold_start_s=0.0, processed=0,
                     pid=1, at=time.time())


def test_a_concurrent_burst_admits_only_what_the_budget_allows(redis_url: str) -> None:
    model = unique("admit")
    version = VersionInfo(model=model, version="v1", state="stable", artifact="synthetic:", sha256="0" * 64,
                          latency_budget_ms=1000.0)
    key = KeyInfo(key_id="k", tenant=unique("t"), is_admin=False)

    async def burst() -> int:
        client = connections.connect(redis_url)
        try:
            # One live worker serving 10 jobs/s and an empty backlog: a 1 s budget holds 10 jobs.
            await heartbeats.beat(client, model, "v1", "w1", _serving(items_per_s=10.0))
            admission = Admission(redis=client)

            async def one() -> bool:
                try:
                    await admission.admit(key, version, lane="online", count=1)
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
    key = KeyInfo(key_id="k", tenant=unique("t"), is_admin=False)

    async def admitted_before_refusal() -> tuple[int, bool]:
        client = connections.connect(redis_url)
        try:
            await heartbeats.beat(client, model, "v1", "w1", _serving(items_per_s=10.0))
            # No load cache: every admission reads the backlog, which never shows these jobs.
            admission = Admission(redis=client, load_cache_s=0.0)
            admitted = 0
            while admitted < 50:
                try:
                    await admission.admit(key, version, lane="online", count=1)
                except TooManyRequests:
                    break
                admitted += 1
            admission.written(version, lane="online", count=admitted)
            # Written, and still not in the stream (nothing was XADDed): the budget is free again.
            await admission.admit(key, version, lane="online", count=1)
            return admitted, True
        finally:
            await client.aclose()

    assert asyncio.run(admitted_before_refusal()) == (10, True)


# --- over HTTP: the lanes -------------------------------------------------------------------------

# What one warm MiniLM worker serves on this 2-core machine (DESIGN §3, §9: 71.9 texts/s in process):
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
    assert rds.xlen(keys.stream(model, "v1", "bulk")) == 300
    assert rds.xlen(keys.stream(model, "v1", "online")) == 0
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
    assert rds.xlen(keys.stream(model, "v1", "online")) == 0


def test_the_schema_documents_the_lane_defaults_and_the_bulk_lane_hint(anon: httpx.Client) -> None:
    spec = anon.get("/openapi.json").json()
    schemas = spec["components"]["schemas"]
    assert schemas["SubmitBulk"]["properties"]["lane"]["default"] == "bulk"
    assert schemas["SubmitJob"]["properties"]["lane"]["default"] == "online"
    for path in ("/v1/models/{model}/jobs", "/v1/models/{model}/jobs:bulk"):
        refused = spec["paths"][path]["post"]["responses"]["429"]
        assert refused["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResource"}
    assert "retry_with" in schemas["ErrorDetail"]["properties"]
