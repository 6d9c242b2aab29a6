"""The API's events loop (api/event_hub.py) keeps waking long-polls while a routing reload waits on a
slow Postgres: a reload must never sit between a job's event and the caller waiting for it. A
long-poll is woken by its job's final state only; an event stream by every change."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest
import redis
from sqlalchemy import text

from api import job_subscriptions
from api.event_hub import EventHub
from launch.seed import Seeded
from sluice.registry.store import Registry
from sluice.wire import connections, events, keys, scripts
from tests.support import ApiServer, claim_one, finish_one_call, http_client, queue_in_redis, unique, wait_until

WAIT_S = 8.0


@contextmanager
def routing_table_locked(registry: Registry) -> Iterator[Callable[[], int]]:
    """Hold an ACCESS EXCLUSIVE lock on `routing_weights` in a real transaction, as a long migration
    or a stuck session would; answer a probe of how many sessions wait on it."""
    with registry.engine.connect() as locker, registry.engine.connect() as observer:
        locker.exec_driver_sql("LOCK TABLE routing_weights IN ACCESS EXCLUSIVE MODE")

        def waiting() -> int:
            return int(
                observer.execute(
                    text("SELECT count(*) FROM pg_locks WHERE relation = 'routing_weights'::regclass AND NOT granted")
                ).scalar_one()
            )

        try:
            yield waiting
        finally:
            locker.rollback()


def test_a_long_poll_returns_at_once_while_a_routing_reload_waits_on_postgres(
    api: ApiServer,
    demo: httpx.Client,
    seeded: Seeded,
    registry: Registry,
    rds: redis.Redis,
    register_synthetic: Callable[..., str],
) -> None:
    model = register_synthetic("hub")  # no worker: the job stays queued until cancelled
    submitted = demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": "wait for me"}})
    assert submitted.status_code == 202, submitted.text
    job_id = submitted.json()["id"]
    with (
        routing_table_locked(registry) as waiting,
        http_client(api.url, seeded.demo_key) as poller,
        ThreadPoolExecutor(max_workers=1) as pool,
    ):
        rds.publish(events.channel(rds), events.encode(events.RoutingChanged(model=model)))
        wait_until(lambda: waiting() >= 1, timeout_s=10, what="the API's routing reload waiting on the lock")
        poll = pool.submit(poller.get, f"/v1/jobs/{job_id}", params={"wait": WAIT_S})
        time.sleep(0.3)  # the long-poll is parked on the job's event
        cancelled_at = time.monotonic()
        assert demo.delete(f"/v1/jobs/{job_id}").status_code == 200
        answer = poll.result(timeout=WAIT_S + 10)
        answered_after = time.monotonic() - cancelled_at
        assert waiting() >= 1, "the reload stopped waiting before the long-poll was judged"
        # Read before the lock goes: the waiting reload may finish before this thread runs again.
        released_at = time.time()
    assert answer.status_code == 200 and answer.json()["status"] == "cancelled", answer.text
    assert answered_after < 1.0, f"the long-poll answered {answered_after:.1f} s after the job was cancelled"
    # Once the lock is gone the reload that waited on it completes.
    routing = api.app.state.sluice.routing
    wait_until(lambda: (routing.loaded_at or 0) >= released_at, timeout_s=10, what="the routing reload")


def test_a_long_poll_is_woken_by_its_jobs_final_state_and_an_event_stream_by_every_change(redis_url: str) -> None:
    """Every wake-up costs the long-poll a read of the job; only a final state ends it."""
    job_id = unique("job_")

    async def scenario() -> None:
        async with listening_hub(redis_url) as hub:
            # Once a watch returns its job's channel is subscribed: one publish each suffices.
            long_poll, stream = await hub.watch_final((job_id,)), await hub.watch(job_id)
            await events.publish(hub.redis, events.JobChanged(id=job_id, status="running"))
            await asyncio.wait_for(stream.wait(), timeout=10)
            assert not long_poll.event.is_set()
            stream.clear()
            await events.publish(hub.redis, events.JobChanged(id=job_id, status="succeeded"))
            await asyncio.wait_for(long_poll.event.wait(), timeout=10)
            assert long_poll.take() == {job_id}
            assert stream.is_set()
            hub.unwatch_final((job_id,), long_poll)
            hub.unwatch(job_id, stream)
            assert hub.jobs.channels == 0

    asyncio.run(scenario())


@contextlib.asynccontextmanager
async def listening_hub(redis_url: str) -> AsyncIterator[EventHub]:
    """An API replica's hub on a client of its own, listening."""
    client = connections.connect(redis_url)
    hub = EventHub(redis=client, on_control=lambda _: None)
    listening = asyncio.create_task(hub.run())
    try:
        await asyncio.wait_for(hub.connected.wait(), timeout=10)
        yield hub
    finally:
        listening.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await listening
        await client.aclose()


def finish(rds: redis.Redis, model: str, job_ids: list[str]) -> None:
    """Run each job as a worker does: the claim script (`running`), then the finish script."""
    for job_id in job_ids:
        assert claim_one(rds, model, job_id, "demo")[0] == "run"
        assert rds.eval(scripts.FINISH, *finish_one_call(rds, model, job_id, '{"ok":true}')) == [1]


async def settled(hub: EventHub, received: int) -> None:
    """Until the hub has read `received` job messages, then a moment longer for any surplus."""
    for _ in range(1000):
        if hub.jobs.received >= received:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)


def test_a_hub_without_waiters_reads_no_job_events_while_jobs_finish(redis_url: str, rds: redis.Redis) -> None:
    model = unique("quiet")

    async def scenario() -> None:
        async with listening_hub(redis_url) as hub:
            ids = await queue_in_redis(hub.redis, model, [{"text": f"job {n}"} for n in range(20)])
            finish(rds, model, ids)
            await asyncio.sleep(0.3)
            assert await hub.redis.hget(keys.job(ids[-1]), "status") == b"succeeded"
            assert hub.jobs.received == 0
            assert hub.jobs.channels == 0

    asyncio.run(scenario())


def test_a_hub_reads_only_the_events_of_jobs_its_own_waiters_watch(redis_url: str, rds: redis.Redis) -> None:
    """Two API replicas: B waits on twenty jobs, A on one; A's count does not grow with B's traffic."""
    model = unique("two")

    async def scenario() -> None:
        async with listening_hub(redis_url) as a, listening_hub(redis_url) as b:
            mine, *theirs = await queue_in_redis(a.redis, model, [{"text": f"job {n}"} for n in range(21)])
            at_a = await a.watch_final((mine,))
            at_b = await b.watch_final(theirs)
            finish(rds, model, theirs)
            await settled(b, 2 * len(theirs))  # `running`, then `succeeded`
            assert a.jobs.received == 0
            assert b.jobs.received == 2 * len(theirs)
            assert at_b.take() == set(theirs)
            assert not at_a.event.is_set()
            finish(rds, model, [mine])
            await settled(a, 2)
            assert (a.jobs.received, b.jobs.received) == (2, 2 * len(theirs))
            assert at_a.take() == {mine}
            a.unwatch_final((mine,), at_a)
            b.unwatch_final(theirs, at_b)
            # Unsubscribed once the last waiter left (after the linger): later changes reach neither.
            await asyncio.sleep(job_subscriptions.LINGER_S + 0.3)
            for job_id in theirs[:5]:
                await events.publish(a.redis, events.JobChanged(id=job_id, status="succeeded"))
            await asyncio.sleep(0.3)
            assert (a.jobs.received, b.jobs.received) == (2, 2 * len(theirs))

    asyncio.run(scenario())


def test_a_change_published_as_soon_as_a_watch_returns_is_never_missed(
    redis_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The watch returns only once the server confirmed the subscription, so a final state written
    right after it (before the waiter's read would even reach Redis) still wakes the waiter; also
    for a job whose channel was just left and joined again, before the leave was answered."""
    monkeypatch.setattr(job_subscriptions, "LINGER_S", 0.0)  # every leave goes out at once

    async def scenario() -> None:
        async with listening_hub(redis_url) as hub:
            publisher = connections.connect(redis_url)
            try:
                for attempt in range(30):
                    job_id = unique("job_")
                    if attempt % 2:
                        first = await hub.watch_final((job_id,))
                        hub.unwatch_final((job_id,), first)
                        await asyncio.sleep(0)  # the SUNSUBSCRIBE is sent, not yet answered
                    watch = await hub.watch_final((job_id,))
                    await events.publish(publisher, events.JobChanged(id=job_id, status="succeeded"))
                    await asyncio.wait_for(watch.event.wait(), timeout=5)
                    assert watch.take() == {job_id}
                    hub.unwatch_final((job_id,), watch)
            finally:
                await publisher.aclose()

    asyncio.run(scenario())


def test_a_waiter_cancelled_while_its_subscription_is_on_its_way_leaves_no_watch_behind(redis_url: str) -> None:
    """A client that hangs up while the watch waits for the server's confirmation."""

    async def scenario() -> None:
        async with listening_hub(redis_url) as hub:
            for watching in (hub.watch_final((unique("job_"), unique("job_"))), hub.watch(unique("job_"))):
                task: asyncio.Task[object] = asyncio.create_task(watching)
                await asyncio.sleep(0)
                assert hub.jobs.channels > 0
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                assert hub.jobs.channels == 0
                assert not hub._waiters and not hub._final_watches

    asyncio.run(scenario())


def test_a_waiter_whose_subscription_dropped_is_woken_once_it_is_back(redis_url: str, rds: redis.Redis) -> None:
    """A change announced while the hub's job connection is down is lost: the waiter is woken
    without one (an empty `take`, so it re-reads), and later changes arrive again."""
    lost, later = unique("job_"), unique("job_")

    async def scenario() -> None:
        async with listening_hub(redis_url) as hub:
            watch = await hub.watch_final((lost, later))
            connection = hub.jobs._connections[""].pubsub.connection
            assert connection is not None and connection._writer is not None
            host, port = connection._writer.get_extra_info("sockname")[:2]
            rds.execute_command("CLIENT", "KILL", "ADDR", f"{host}:{port}")
            rds.spublish(events.job_channel(rds, lost), events.encode(events.JobChanged(id=lost, status="succeeded")))
            await asyncio.wait_for(watch.event.wait(), timeout=15)
            # Either the event made it after all, or the gap woke the waiter to re-read everything.
            assert watch.take() in (set(), {lost})
            async with asyncio.timeout(15):
                while not watch.event.is_set():
                    await events.publish(hub.redis, events.JobChanged(id=later, status="failed"))
                    await asyncio.sleep(0.1)
            assert later in watch.take()
            hub.unwatch_final((lost, later), watch)

    asyncio.run(scenario())


def test_a_long_poll_on_a_job_already_final_answers_at_once(
    api: ApiServer, demo: httpx.Client, register_synthetic: Callable[..., str],
) -> None:
    """The waiter subscribes after the job's last event: the read after the subscription sees it."""
    model = register_synthetic("late")  # no worker: the job stays queued until cancelled
    job_id = demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": "late"}}).json()["id"]
    assert demo.delete(f"/v1/jobs/{job_id}").status_code == 200
    started = time.monotonic()
    answer = demo.get(f"/v1/jobs/{job_id}", params={"wait": WAIT_S})
    assert answer.status_code == 200 and answer.json()["status"] == "cancelled", answer.text
    assert time.monotonic() - started < 2.0
    answer = demo.get("/v1/jobs", params={"ids": job_id, "wait": WAIT_S})
    assert answer.status_code == 200, answer.text
    assert [job["status"] for job in answer.json()["jobs"]] == ["cancelled"]
    assert time.monotonic() - started < 4.0
