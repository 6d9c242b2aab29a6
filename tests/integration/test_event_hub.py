"""The API's events loop (api/events.py) keeps waking long-polls while a routing reload waits on a
slow Postgres: a reload must never sit between a job's event and the caller waiting for it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import redis
from sqlalchemy import text

from launch.seed import Seeded
from sluice import events
from sluice.registry.store import Registry
from tests.support import ApiServer, http_client, wait_until

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
