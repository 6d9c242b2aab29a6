"""The Python clients against the real API (in process) and Redis, with an in-process synthetic
worker where jobs must run; jobs that must stay pending go to a model no worker serves."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from prometheus_client import REGISTRY

from launch.seed import Seeded
from sluice.wire.connections import connect
from sluice_client import (
    AsyncClient,
    AuthError,
    ClientError,
    InvalidRequest,
    NotFoundError,
    RateLimited,
    SluiceClient,
    WaitTimeout,
)
from tests.support import ApiServer, unique
from workers.models.synthetic import SyntheticHandler
from workers.worker import Worker


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


async def test_async_client_calls_past_max_connections_wait_their_turn_then_time_out(
    client: Callable[..., AsyncClient],
    register_synthetic: Callable[..., str],
) -> None:
    """Long-polls on a job no worker runs hold their connection for their whole wait: with one
    connection, three of 0.4 s run one after another, and a call that finds none free within the
    client's timeout fails as httpx's own pool would."""
    model = register_synthetic("aclient-cap")  # no worker: its jobs stay queued
    async with client(max_connections=1, timeout_s=5) as sluice:
        job = await sluice.submit(model, {"text": "never runs"})
        started = time.monotonic()
        polls = await asyncio.gather(*(sluice.job(job["id"], wait_s=0.4) for _ in range(3)))
        assert [poll["status"] for poll in polls] == ["queued"] * 3
        assert time.monotonic() - started >= 1.2
    # Twenty places are twenty at once, however the client splits them over its pools.
    async with client(max_connections=20, timeout_s=5) as sluice:
        started = time.monotonic()
        polls = await asyncio.gather(*(sluice.job(job["id"], wait_s=1.0) for _ in range(20)))
        assert [poll["status"] for poll in polls] == ["queued"] * 20
        assert time.monotonic() - started < 1.9
    async with client(max_connections=1, timeout_s=0.3) as sluice:
        holding = asyncio.create_task(sluice.job(job["id"], wait_s=1.0))
        await asyncio.sleep(0.05)
        with pytest.raises(httpx.PoolTimeout):
            await sluice.job(job["id"])
        assert (await holding)["status"] == "queued"


# --- many jobs, one long-poll ----------------------------------------------------------------------


def _requests(route: str) -> float:
    """GET requests the in-process API has answered 200 on `route` (its metrics, a template)."""
    labels = {"route": route, "method": "GET", "status": "200"}
    return REGISTRY.get_sample_value("sluice_api_requests_total", labels) or 0.0


async def _counted(route: str, at_least: float) -> float:
    """`_requests(route)` once it reaches `at_least` (or after a second): the API counts a request
    once its answer is sent, which can be just after the client has read it."""
    for _ in range(100):
        if _requests(route) >= at_least:
            break
        await asyncio.sleep(0.01)
    return _requests(route)


async def _cancel_in_turn(sluice: AsyncClient, ids: list[str], *, gap_s: float) -> None:
    for job_id in ids:
        await asyncio.sleep(gap_s)
        await sluice.cancel(job_id)


async def test_wait_many_answers_every_job_in_the_order_of_ids(
    client: Callable[..., AsyncClient], register_synthetic: Callable[..., str]
) -> None:
    model = register_synthetic("aclient-many")
    async with client() as sluice:
        ids = await sluice.submit_bulk(model, [{"text": f"t{i}"} for i in range(5)])
        await sluice.cancel(ids[1])
        order = [ids[3], ids[0], ids[4], ids[2]]
        cancelling = asyncio.create_task(_cancel_in_turn(sluice, order, gap_s=0.1))
        jobs = await sluice.wait_many([*ids, ids[1]], timeout_s=30)
        await cancelling
    assert [job["id"] for job in jobs] == [*ids, ids[1]]
    assert {job["status"] for job in jobs} == {"cancelled"}


async def test_as_completed_yields_jobs_in_the_order_they_finish(
    client: Callable[..., AsyncClient], register_synthetic: Callable[..., str]
) -> None:
    model = register_synthetic("aclient-asc")
    async with client() as sluice:
        ids = await sluice.submit_bulk(model, [{"text": f"t{i}"} for i in range(4)])
        order = [ids[2], ids[0], ids[3], ids[1]]
        cancelling = asyncio.create_task(_cancel_in_turn(sluice, order, gap_s=0.3))
        seen = [job["id"] async for job in sluice.as_completed(ids, timeout_s=30)]
        await cancelling
    assert seen == order


async def test_waits_on_many_jobs_raise_a_timeout_naming_the_jobs_not_final(
    client: Callable[..., AsyncClient], register_synthetic: Callable[..., str]
) -> None:
    model = register_synthetic("aclient-many-timeout")
    async with client() as sluice:
        ids = await sluice.submit_bulk(model, [{"text": f"t{i}"} for i in range(3)])
        await sluice.cancel(ids[1])
        started = time.monotonic()
        with pytest.raises(WaitTimeout) as timeout:
            await sluice.wait_many(ids, timeout_s=0.5)
        assert 0.45 < time.monotonic() - started < 5
        assert timeout.value.pending == [ids[0], ids[2]] and ids[2] in str(timeout.value)
        seen = []
        with pytest.raises(WaitTimeout):
            async for job in sluice.as_completed(ids, timeout_s=0.3):
                seen.append(job["id"])
        assert seen == [ids[1]]
        with pytest.raises(ClientError) as missing:
            await sluice.wait_many([ids[1], "job_doesnotexist"], timeout_s=5)
    assert (missing.value.status, missing.value.code) == (404, "not_found")


async def test_one_long_poll_waits_on_many_jobs(
    client: Callable[..., AsyncClient], register_synthetic: Callable[..., str], aredis: aioredis.Redis
) -> None:
    idle, busy = register_synthetic("aclient-idle"), register_synthetic("aclient-busy")
    async with client() as sluice:
        pending = await sluice.submit_bulk(idle, [{"text": f"t{i}"} for i in range(50)])
        before = _requests("/v1/jobs"), _requests("/v1/jobs/{job_id}")
        with pytest.raises(WaitTimeout):
            await sluice.wait_many(pending, timeout_s=1.0)
        # 50 jobs waited on for a second: one request, not one per job.
        assert (await _counted("/v1/jobs", before[0] + 1) - before[0],
                _requests("/v1/jobs/{job_id}") - before[1]) == (1, 0)

        ids = await sluice.submit_bulk(busy, [{"text": f"text {i}"} for i in range(60)])
        before = _requests("/v1/jobs"), _requests("/v1/jobs/{job_id}")
        async with running(aredis, busy):
            jobs = await sluice.wait_many(ids, timeout_s=60)
        requests = await _counted("/v1/jobs", before[0] + 1) - before[0]
    assert [job["output"]["echo"]["text"] for job in jobs] == [f"text {i}" for i in range(60)]
    # About one request per batch the worker finished (batches of up to 16), never one per job.
    assert 1 <= requests <= 20 and _requests("/v1/jobs/{job_id}") == before[1], requests


def test_the_sync_client_waits_on_many_jobs_with_the_same_logic(
    api: ApiServer, seeded: Seeded, register_synthetic: Callable[..., str]
) -> None:
    model = register_synthetic("client-many")
    with SluiceClient(base_url=api.url, api_key=seeded.demo_key) as sluice:
        ids = sluice.submit_bulk(model, [{"text": f"t{i}"} for i in range(3)])
        sluice.cancel(ids[2])
        later = threading.Timer(0.3, sluice.cancel, args=[ids[0]])
        later.start()
        seen = [job["id"] for job in itertools.islice(sluice.as_completed(ids, timeout_s=30), 2)]
        later.join()
        assert seen == [ids[2], ids[0]]
        sluice.cancel(ids[1])
        assert [job["id"] for job in sluice.wait_many(ids, timeout_s=30)] == ids
        with pytest.raises(WaitTimeout):
            sluice.wait_many([*ids, sluice.submit(model, {"text": "never runs"})["id"]], timeout_s=0.3)


# --- submit and wait in one request -----------------------------------------------------------------


def _answered(route: str, method: str, status: int) -> float:
    labels = {"route": route, "method": method, "status": str(status)}
    return REGISTRY.get_sample_value("sluice_api_requests_total", labels) or 0.0


async def test_run_submits_and_gets_the_result_in_one_request(
    client: Callable[..., AsyncClient], register_synthetic: Callable[..., str], aredis: aioredis.Redis
) -> None:
    model = register_synthetic("aclient-oneshot")
    submit = "/v1/models/{model}/jobs"
    async with running(aredis, model), client() as sluice:
        before = _answered(submit, "POST", 200), _answered("/v1/jobs/{job_id}", "GET", 200)
        jobs = await asyncio.gather(*(sluice.run(model, {"text": f"run {i}"}, timeout_s=30) for i in range(8)))
        after = _answered(submit, "POST", 200), _answered("/v1/jobs/{job_id}", "GET", 200)
    assert [job["status"] for job in jobs] == ["succeeded"] * 8
    assert [job["output"]["echo"]["text"] for job in jobs] == [f"run {i}" for i in range(8)]
    # Each job: one POST answered 200 with its result, and no read.
    assert (after[0] - before[0], after[1] - before[1]) == (8, 0)


async def test_run_raises_a_timeout_when_the_job_is_not_final_in_time(
    client: Callable[..., AsyncClient], register_synthetic: Callable[..., str]
) -> None:
    model = register_synthetic("aclient-oneshot-idle")  # no worker
    async with client() as sluice:
        started = time.monotonic()
        with pytest.raises(WaitTimeout) as timeout:
            await sluice.run(model, {"text": "never runs"}, timeout_s=0.5)
        assert 0.4 < time.monotonic() - started < 5
        [job_id] = timeout.value.pending
        assert (await sluice.job(job_id))["status"] == "queued"


def test_submit_with_wait_answers_202_with_the_queued_job_when_it_is_not_final(
    api: ApiServer, seeded: Seeded, register_synthetic: Callable[..., str]
) -> None:
    model = register_synthetic("rest-oneshot-idle")  # no worker
    headers = {"Authorization": f"Bearer {seeded.demo_key}", "Idempotency-Key": "oneshot-1"}
    with httpx.Client(base_url=api.url, headers=headers, timeout=30) as http:
        started = time.monotonic()
        response = http.post(f"/v1/models/{model}/jobs", params={"wait": 0.3}, json={"input": {"text": "x"}})
        assert time.monotonic() - started >= 0.25
        assert response.status_code == 202, response.text
        job = response.json()
        assert job["status"] == "queued" and response.headers["Location"] == f"/v1/jobs/{job['id']}"
        http.delete(f"/v1/jobs/{job['id']}").raise_for_status()
        # A replay of the same request answers the job, final now, with 200 and at once.
        replay = http.post(f"/v1/models/{model}/jobs", params={"wait": 5}, json={"input": {"text": "x"}})
        assert replay.status_code == 200, replay.text
        assert replay.json()["id"] == job["id"] and replay.json()["status"] == "cancelled"
        assert replay.headers["Idempotent-Replayed"] == "true"
        bad = http.post(f"/v1/models/{model}/jobs", params={"wait": -1}, json={"input": {"text": "y"}},
                        headers={"Idempotency-Key": "oneshot-2"})
        assert bad.status_code == 422, bad.text


def test_the_sync_client_runs_a_job(
    api: ApiServer, seeded: Seeded, register_synthetic: Callable[..., str]
) -> None:
    model = register_synthetic("client-oneshot")  # no worker: the job is cancelled while waited on
    with SluiceClient(base_url=api.url, api_key=seeded.demo_key) as sluice:
        queued = sluice.run(model, {"text": "waits"}, timeout_s=0.3)
        assert queued["status"] == "queued"
        later = threading.Timer(0.3, sluice.cancel, args=[queued["id"]])
        later.start()
        assert sluice.wait(queued["id"], timeout_s=30)["status"] == "cancelled"
        later.join()


# --- typed errors, retries, webhook verification ------------------------------------------------------


def test_errors_come_as_their_kind_with_the_api_s_code(
    api: ApiServer, seeded: Seeded, register_synthetic: Callable[..., str]
) -> None:
    model = register_synthetic("client-errors")
    with SluiceClient(base_url=api.url, api_key=seeded.demo_key) as sluice:
        with pytest.raises(NotFoundError) as missing:
            sluice.submit("no-such-model", {"text": "x"})
        with pytest.raises(InvalidRequest) as invalid:
            sluice.submit(model, {"text": ""})
    with SluiceClient(base_url=api.url, api_key="sk_wrong") as stranger, pytest.raises(AuthError) as denied:
        stranger.model(model)
    assert (missing.value.status, missing.value.code) == (404, "not_found")
    assert (invalid.value.status, invalid.value.code) == (422, "invalid_input")
    assert denied.value.status == 401
    assert all(isinstance(e.value, ClientError) for e in (missing, invalid, denied))


async def test_a_429_is_retried_after_its_retry_after_and_raised_when_retries_run_out(
    api: ApiServer, admin: Any, register_synthetic: Callable[..., str]
) -> None:
    model = register_synthetic("client-retry")  # no worker: jobs stay queued
    created = admin.post("/v1/tenants", json={"id": unique("slow"), "rate_limit_per_s": 0.5})  # a burst of 5
    assert created.status_code == 201, created.text
    key = created.json()["key"]["secret"]
    async with AsyncClient(base_url=api.url, api_key=key, retries=0) as impatient:
        for i in range(5):
            await impatient.submit(model, {"text": f"within the burst {i}"})
        with pytest.raises(RateLimited) as limited:
            await impatient.submit(model, {"text": "over it"})
    assert limited.value.status == 429 and limited.value.retry_after_s is not None
    assert 1 <= limited.value.retry_after_s <= 5
    started = time.monotonic()
    async with AsyncClient(base_url=api.url, api_key=key, retries=3) as patient:
        job = await patient.submit(model, {"text": "waits for its token"})
    assert job["status"] == "queued" and time.monotonic() - started >= 1
