"""`GET /v1/jobs?ids=…&wait=N` over the real API and Redis: one request waits on many jobs and
answers as soon as any is final.

The jobs go to models no worker serves, so they stay queued until a test cancels one (a real
final transition, with its real event).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest

from api.event_hub import EventHub
from launch.seed import Seeded
from sluice.settings import Settings
from sluice.wire import events
from sluice.wire.connections import connect
from sluice.wire.jobs import MAX_WAIT_IDS
from sluice.wire.keys import new_job_id
from tests.support import ApiServer, serving

Submit = Callable[[httpx.Client, int], list[str]]


@pytest.fixture
def queued(register_synthetic: Callable[..., str]) -> Submit:
    """`count` queued jobs of a fresh model no worker serves, submitted by `client`."""
    model = register_synthetic("waitmany")

    def submit(client: httpx.Client, count: int) -> list[str]:
        response = client.post(
            f"/v1/models/{model}/jobs:bulk", json={"inputs": [{"text": f"t{i}"} for i in range(count)]}
        )
        assert response.status_code == 202, response.text
        return list(response.json()["ids"])

    return submit


@pytest.fixture
async def ademo(api: ApiServer, seeded: Seeded) -> AsyncIterator[httpx.AsyncClient]:
    headers = {"Authorization": f"Bearer {seeded.demo_key}"}
    async with httpx.AsyncClient(base_url=api.url, headers=headers, timeout=60) as client:
        yield client


async def test_one_watch_for_many_jobs_wakes_only_on_a_final_state(redis_url: str) -> None:
    redis = connect(redis_url)
    hub = EventHub(redis=redis, on_control=lambda _: None)
    listening = asyncio.create_task(hub.run())
    a, b, c = new_job_id("minilm", "v1"), new_job_id("minilm", "v1"), new_job_id("minilm", "v1")
    try:
        await asyncio.wait_for(hub.connected.wait(), timeout=10)
        watch = await hub.watch_final([a, b, c])
        await events.publish(redis, events.JobChanged(id=a, status="running"))
        await events.publish(redis, events.JobChanged(id=new_job_id("minilm", "v1"), status="succeeded"))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(watch.event.wait(), timeout=0.5)
        await events.publish(redis, events.JobChanged(id=b, status="failed"))
        await events.publish(redis, events.JobChanged(id=c, status="cancelled"))
        await asyncio.wait_for(watch.event.wait(), timeout=10)
        await asyncio.sleep(0.2)
        assert watch.take() == {b, c} and not watch.event.is_set()
        hub.wake_all()
        assert watch.event.is_set() and watch.take() == set()
        hub.unwatch_final([a, b, c], watch)
        await events.publish(redis, events.JobChanged(id=a, status="succeeded"))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(watch.event.wait(), timeout=0.5)
    finally:
        listening.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await listening
        await redis.aclose()


def _wait(client: httpx.Client, ids: list[str], wait: float = 0) -> dict[str, Any]:
    response = client.get("/v1/jobs", params={"ids": ",".join(ids), "wait": wait})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    queued = {entry["id"] for entry in body.pop("queued", [])}
    # Where queued jobs stand is listed for pending jobs only (tests/integration/test_queue_standing.py).
    assert queued <= set(body["pending"])
    return body


async def _started(client: httpx.AsyncClient, ids: list[str], wait: float) -> asyncio.Task[httpx.Response]:
    """A long-poll in flight: sent, and still waiting half a second later."""
    task = asyncio.create_task(client.get("/v1/jobs", params={"ids": ",".join(ids), "wait": wait}))
    await asyncio.sleep(0.5)
    assert not task.done(), task.result().text
    return task


def test_jobs_already_final_are_answered_at_once(demo: httpx.Client, queued: Submit) -> None:
    a, b, c = queued(demo, 3)
    assert demo.delete(f"/v1/jobs/{b}").status_code == 200
    started = time.monotonic()
    body = _wait(demo, [a, b, c], wait=20)
    assert time.monotonic() - started < 5
    assert [job["id"] for job in body["jobs"]] == [b] and body["jobs"][0]["status"] == "cancelled"
    assert body["pending"] == [a, c] and body["not_found"] == []


def test_without_wait_the_answer_sorts_the_jobs(demo: httpx.Client, queued: Submit) -> None:
    a, b, c = queued(demo, 3)
    assert _wait(demo, [a, b, c]) == {"jobs": [], "pending": [a, b, c], "not_found": []}
    demo.delete(f"/v1/jobs/{c}")
    demo.delete(f"/v1/jobs/{a}")
    body = _wait(demo, [c, b, a])
    assert [job["id"] for job in body["jobs"]] == [c, a] and body["pending"] == [b]


async def test_a_long_poll_answers_when_any_job_becomes_final(
    demo: httpx.Client, ademo: httpx.AsyncClient, queued: Submit
) -> None:
    ids = queued(demo, 5)
    task = await _started(ademo, ids, wait=30)
    cancelled = time.monotonic()
    assert (await ademo.delete(f"/v1/jobs/{ids[3]}")).status_code == 200
    response = await asyncio.wait_for(task, timeout=10)
    assert time.monotonic() - cancelled < 5
    body = response.json()
    assert [job["id"] for job in body["jobs"]] == [ids[3]]
    assert body["pending"] == ids[:3] + ids[4:] and body["not_found"] == []


async def test_a_job_starting_to_run_does_not_end_the_wait(
    demo: httpx.Client, ademo: httpx.AsyncClient, queued: Submit, redis_url: str
) -> None:
    ids = queued(demo, 2)
    task = await _started(ademo, ids, wait=30)
    redis = connect(redis_url)
    try:
        await events.publish(redis, events.JobChanged(id=ids[0], status="running"))
        await asyncio.sleep(0.5)
        assert not task.done(), task.result().text
        await events.publish(redis, events.JobChanged(id=ids[1], status="succeeded"))
        # The event is not the record: the job is re-read, still queued, and the wait goes on.
        await asyncio.sleep(0.5)
        assert not task.done(), task.result().text
    finally:
        await redis.aclose()
    await ademo.delete(f"/v1/jobs/{ids[1]}")
    body = (await asyncio.wait_for(task, timeout=10)).json()
    assert [job["id"] for job in body["jobs"]] == [ids[1]] and body["pending"] == [ids[0]]


def test_a_wait_with_none_final_answers_200_when_it_runs_out(demo: httpx.Client, queued: Submit) -> None:
    ids = queued(demo, 3)
    started = time.monotonic()
    body = _wait(demo, ids, wait=0.6)
    assert 0.55 <= time.monotonic() - started < 5
    assert body == {"jobs": [], "pending": ids, "not_found": []}


def test_another_tenants_unknown_and_malformed_ids_are_not_found_and_answered_at_once(
    demo: httpx.Client, new_tenant: Callable[..., tuple[str, httpx.Client]], queued: Submit
) -> None:
    _, other = new_tenant("waitmany")
    [theirs] = queued(other, 1)
    [mine] = queued(demo, 1)
    unknown, malformed = new_job_id("minilm", "v1"), "not-a-job"
    started = time.monotonic()
    body = _wait(demo, [theirs, mine, unknown, malformed], wait=20)
    assert time.monotonic() - started < 5
    assert body == {"jobs": [], "pending": [mine], "not_found": [theirs, unknown, malformed]}
    # Their job is theirs alone: final for them, and still not found for us.
    assert other.delete(f"/v1/jobs/{theirs}").status_code == 200
    assert _wait(other, [theirs])["jobs"][0]["status"] == "cancelled"
    assert _wait(demo, [theirs]) == {"jobs": [], "pending": [], "not_found": [theirs]}


def test_an_id_listed_twice_is_answered_once(demo: httpx.Client, queued: Submit) -> None:
    a, b = queued(demo, 2)
    demo.delete(f"/v1/jobs/{b}")
    body = _wait(demo, [a, b, a, b, b], wait=5)
    assert [job["id"] for job in body["jobs"]] == [b] and body["pending"] == [a]
    spaced = demo.get("/v1/jobs", params={"ids": f" {a} , {b},{a} "}).json()
    assert [job["id"] for job in spaced["jobs"]] == [b] and spaced["pending"] == [a]


def test_at_most_256_ids(demo: httpx.Client) -> None:
    ids = [new_job_id("minilm", "v1") for _ in range(MAX_WAIT_IDS + 1)]
    assert MAX_WAIT_IDS == 256
    assert len(_wait(demo, ids[:MAX_WAIT_IDS])["not_found"]) == MAX_WAIT_IDS
    over = demo.get("/v1/jobs", params={"ids": ",".join(ids)})
    assert over.status_code == 422 and over.json()["error"]["code"] == "invalid_input", over.text
    assert "257" in over.json()["error"]["message"]
    for params in ({"ids": ""}, {"ids": ",,"}, {}):
        response = demo.get("/v1/jobs", params=params)
        assert response.status_code == 422, (params, response.text)


def test_the_wait_needs_a_key(anon: httpx.Client) -> None:
    assert anon.get("/v1/jobs", params={"ids": new_job_id("minilm", "v1")}).status_code == 401


@pytest.fixture
def drainable(settings: Settings) -> Iterator[ApiServer]:
    """A replica of its own, so draining it disturbs no other test."""
    with serving(settings) as server:
        yield server


def _drain(api: ApiServer) -> None:
    """What the first SIGTERM does to a replica's state (`api.server.TwoStageServer._drain`)."""
    assert api.loop is not None
    state = api.app.state.sluice

    async def drain() -> None:
        state.draining.set()
        state.hub.wake_all()

    asyncio.run_coroutine_threadsafe(drain(), api.loop).result(timeout=10)


async def test_a_draining_replica_ends_waits_at_once_with_the_current_state(
    drainable: ApiServer, seeded: Seeded, demo: httpx.Client, queued: Submit
) -> None:
    ids = queued(demo, 2)
    headers = {"Authorization": f"Bearer {seeded.demo_key}"}
    async with httpx.AsyncClient(base_url=drainable.url, headers=headers, timeout=60) as client:
        task = await _started(client, ids, wait=30)
        _drain(drainable)
        body = (await asyncio.wait_for(task, timeout=10)).json()
        body.pop("queued", None)
        assert body == {"jobs": [], "pending": ids, "not_found": []}
        started = time.monotonic()
        later = (await client.get("/v1/jobs", params={"ids": ",".join(ids), "wait": 30})).json()
        assert time.monotonic() - started < 5
    later.pop("queued", None)
    assert later == {"jobs": [], "pending": ids, "not_found": []}
