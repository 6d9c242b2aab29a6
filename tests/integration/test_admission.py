"""Load shedding under concurrency, on real Redis: a burst of submissions that all read the same
backlog snapshot must still admit only what the latency budget allows."""

from __future__ import annotations

import asyncio
import time

from api.admission import Admission
from sluice import connections, heartbeats
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
