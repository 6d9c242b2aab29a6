"""Idempotency-Key on the submit path, over the real API and Redis (ARCHITECTURE, "Idempotency-Key").

A key claimed by an API that then died must not lock its tenant out for a day; a replay of an
accepted request gets the original answer whatever the API's state (draining, a breaker open on
the version it went to); a replay whose jobs have expired says so with its own code.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import redis

from api.routes.jobs import SubmitJob, _request_hash
from sluice.settings import Settings
from sluice.wire import connections, keys
from sluice.wire.broker import Broker
from tests.support import ApiServer, http_client, lane_jobs, record_failures, serving, unique, wait_until

SUBMIT = "/v1/models/{model}/jobs"


def _tenant(admin: httpx.Client, client_for: Callable[[str], httpx.Client]) -> tuple[str, httpx.Client]:
    response = admin.post("/v1/tenants", json={"id": unique("idem")})
    assert response.status_code == 201, response.text
    return response.json()["id"], client_for(response.json()["key"]["secret"])


def test_a_key_left_in_progress_by_a_dead_api_is_claimable_again_within_seconds(
    redis_url: str,
    rds: redis.Redis,
    admin: httpx.Client,
    client_for: Callable[[str], httpx.Client],
    register_synthetic: Callable[..., str],
) -> None:
    model = register_synthetic("idem-dead")
    tenant, client = _tenant(admin, client_for)
    body = {"input": {"text": "exactly once"}}
    key = unique("order")

    async def claim_and_die() -> None:
        """What an API replica does with the key before it queues anything, and then nothing more."""
        redis_client = connections.connect(redis_url)
        try:
            dead = Broker(redis=redis_client, result_ttl_s=3600)
            await dead.claim_idempotency_key(tenant, key, _request_hash(model, SubmitJob.model_validate(body)))
        finally:
            await redis_client.aclose()

    asyncio.run(claim_and_die())
    died = time.monotonic()
    busy = client.post(SUBMIT.format(model=model), json=body, headers={"Idempotency-Key": key})
    assert busy.status_code == 409 and busy.headers["Retry-After"] == "1", busy.text

    answers: list[httpx.Response] = []

    def retried() -> bool:
        answers.append(client.post(SUBMIT.format(model=model), json=body, headers={"Idempotency-Key": key}))
        return answers[-1].status_code == 202

    wait_until(retried, timeout_s=30, interval_s=0.25, what="the key to be claimable again")
    recovered_s = time.monotonic() - died
    assert recovered_s < 10, recovered_s
    assert {a.status_code for a in answers[:-1]} <= {409}, [a.text for a in answers]
    job_id = answers[-1].json()["id"]
    replay = client.post(SUBMIT.format(model=model), json=body, headers={"Idempotency-Key": key})
    assert replay.status_code == 202 and replay.json()["id"] == job_id
    assert lane_jobs(rds, model, "v1", "online") == 1


@pytest.fixture(scope="module")
def strict_api(settings: Settings) -> Iterator[ApiServer]:
    """A replica whose breakers open on 5 failures in 5 finished jobs and stay open a minute."""
    tuned = settings.model_copy(update={"breaker_min_samples": 5, "breaker_open_s": 60.0})
    with serving(tuned) as server:
        yield server


def _on_loop(api: ApiServer, callback: Callable[[], Any]) -> None:
    """Run `callback` on the API's event loop (asyncio objects are not thread-safe)."""
    assert api.loop is not None

    async def call() -> None:
        callback()

    asyncio.run_coroutine_threadsafe(call(), api.loop).result(timeout=10)


def _breaker(api: ApiServer, model: str, version: str) -> str:
    return str(api.readyz().get("breakers", {}).get(f"{model}/{version}", {}).get("state"))


def test_a_replay_is_answered_while_the_api_is_draining(
    strict_api: ApiServer,
    seeded: Any,
    register_synthetic: Callable[..., str],
) -> None:
    model = register_synthetic("idem-drain")
    headers = {"Idempotency-Key": unique("order")}
    with http_client(strict_api.url, seeded.demo_key) as client:
        first = client.post(SUBMIT.format(model=model), json={"input": {"text": "a"}}, headers=headers)
        assert first.status_code == 202, first.text
        state = strict_api.app.state.sluice
        _on_loop(strict_api, state.draining.set)
        try:
            replay = client.post(SUBMIT.format(model=model), json={"input": {"text": "a"}}, headers=headers)
            fresh = client.post(
                SUBMIT.format(model=model), json={"input": {"text": "a"}}, headers={"Idempotency-Key": unique("order")}
            )
        finally:
            _on_loop(strict_api, state.draining.clear)
    assert replay.status_code == 202, replay.text
    assert replay.json()["id"] == first.json()["id"] and replay.headers["Idempotent-Replayed"] == "true"
    assert fresh.status_code == 503, fresh.text


def test_a_replay_is_answered_while_the_breaker_of_its_version_is_open(
    strict_api: ApiServer,
    seeded: Any,
    rds: redis.Redis,
    register_synthetic: Callable[..., str],
) -> None:
    model = register_synthetic("idem-breaker", versions=("v1", "v2"), weights={"v1": 100.0})
    body = {"input": {"text": "to v2"}, "version": "v2"}
    headers = {"Idempotency-Key": unique("order")}
    with http_client(strict_api.url, seeded.demo_key) as client:
        first = client.post(SUBMIT.format(model=model), json=body, headers=headers)
        assert first.status_code == 202 and first.json()["version"] == "v2", first.text
        record_failures(rds, model, "v2", 5)
        wait_until(lambda: _breaker(strict_api, model, "v2") == "open", timeout_s=10, what="v2's breaker to open")
        refused = client.post(SUBMIT.format(model=model), json=body, headers={"Idempotency-Key": unique("order")})
        replay = client.post(SUBMIT.format(model=model), json=body, headers=headers)
    assert refused.status_code == 503, refused.text
    assert replay.status_code == 202, replay.text
    assert replay.json()["id"] == first.json()["id"] and replay.headers["Idempotent-Replayed"] == "true"


def test_replaying_a_key_whose_jobs_expired_answers_404_job_expired(
    demo: httpx.Client,
    rds: redis.Redis,
    register_synthetic: Callable[..., str],
) -> None:
    model = register_synthetic("idem-expired")
    single = {"Idempotency-Key": unique("order")}
    job_id = demo.post(SUBMIT.format(model=model), json={"input": {"text": "a"}}, headers=single).json()["id"]
    bulk = {"Idempotency-Key": unique("order")}
    ids = demo.post(
        f"{SUBMIT.format(model=model)}:bulk", json={"inputs": [{"text": "b"}, {"text": "c"}]}, headers=bulk
    ).json()["ids"]
    # The records' TTL runs out (result_ttl_s) while the keys' does not (idempotency_ttl_s).
    for expiring in (job_id, ids[1]):
        rds.pexpire(keys.job(expiring), 1)
    wait_until(lambda: not rds.exists(keys.job(job_id), keys.job(ids[1])), timeout_s=5, what="the records to expire")

    for path, body, headers in (
        (SUBMIT, {"input": {"text": "a"}}, single),
        (f"{SUBMIT}:bulk", {"inputs": [{"text": "b"}, {"text": "c"}]}, bulk),
    ):
        replay = demo.post(path.format(model=model), json=body, headers=headers)
        assert replay.status_code == 404, replay.text
        assert replay.json()["error"]["code"] == "job_expired", replay.text
