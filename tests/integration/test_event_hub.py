"""The API's events loop (api/event_hub.py) keeps waking long-polls while a routing reload waits on a
slow Postgres: a reload must never sit between a job's event and the caller waiting for it. A
long-poll is woken by its job's final state only; an event stream by every change."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import redis
from sqlalchemy import text

from api.event_hub import EventHub
from launch.seed import Seeded
from sluice.registry.store import Registry
from sluice.wire import connections, events
from tests.support import ApiServer, http_client, unique, wait_until

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
        client = connections.connect(redis_url)
        hub = EventHub(redis=client, on_control=lambda _: None)
        listening = asyncio.create_task(hub.run())
        try:
            await asyncio.wait_for(hub.connected.wait(), timeout=10)
            long_poll, stream = hub.watch_final((job_id,)), hub.watch(job_id)

            async def publish_until(status: str, woken: asyncio.Event) -> None:
                # Until it lands: the subscription may still be on its way to the server.
                while not woken.is_set():
                    await events.publish(client, events.JobChanged(id=job_id, status=status))
                    await asyncio.sleep(0.05)

            await asyncio.wait_for(publish_until("running", stream), timeout=10)
            assert not long_poll.event.is_set()
            stream.clear()
            await asyncio.wait_for(publish_until("succeeded", long_poll.event), timeout=10)
            assert long_poll.take() == {job_id}
            assert stream.is_set()
            hub.unwatch_final((job_id,), long_poll)
            hub.unwatch(job_id, stream)
        finally:
            listening.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listening
            await client.aclose()

    asyncio.run(scenario())
