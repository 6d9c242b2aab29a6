"""No job waits for a worker that will never come, on real processes: `sluice scheduler` with the
local actuator and its worker processes, on a registry of the test's own (synthetic models).

- A version with 1,000 jobs queued, more than its one worker runs within the drain limit, is
  retired: every job is final within the limit plus 5 s, each succeeded or failed with
  `version_retired`, and none is left queued.
- A job with `timeout_s` 30 on a version that no worker serves (none may be placed, or its
  artifact is refused) is `expired` within 35 s, by the sweeper, with no worker to claim it.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

from sluice.registry import catalog
from sluice.registry.store import Registry
from sluice.wire import connections, events, keys
from sluice.wire.heartbeats import live_since
from sluice.wire.jobs import JobRecord, JobStatus
from sluice.wire.keys import new_job_id
from sluice.wire.streams import queue_jobs
from tests.support import SYNTHETIC_SHA, fresh_database, lane_jobs

from ._support import local_scheduler, read_jobs

pytestmark = [pytest.mark.slow, pytest.mark.soak]

VERSION = "v1"
DRAIN_S = 5.0
JOBS = 1000
# A batch of 8 takes 0.05 + 8 * 0.02 s: about 38 jobs/s on one worker, so 1,000 jobs need ~26 s,
# far past the drain limit.
SLOW = "synthetic:?fixed_s=0.05&per_item_s=0.02&per_token_s=0"
FAST = "synthetic:?fixed_s=0.001&per_item_s=0.0002&per_token_s=0"
# Not a cost model any worker can load: the worker process refuses the artifact.
REFUSED = "synthetic:?no_such_parameter=1"


@contextmanager
def registry_with(*versions: tuple[str, str, int]) -> Iterator[str]:
    """A registry of the test's own holding these (model, artifact, max_replicas), one stable
    version each, at most one process each."""
    with fresh_database("sluice_retire_") as url:
        registry = Registry(url=url, pool_size=1)
        try:
            with registry.session() as session:
                for model, artifact, max_replicas in versions:
                    catalog.create_model(session, name=model, kind="synthetic", actor="test")
                    catalog.register_version(session, model=model, version=VERSION, artifact=artifact,
                                             sha256=SYNTHETIC_SHA, actor="test", state="stable", max_batch_size=8,
                                             max_wait_ms=5, min_replicas=min(1, max_replicas),
                                             max_replicas=max_replicas)
        finally:
            registry.dispose()
        yield url


@contextmanager
def scheduler(database_url: str, redis_url: str, home: Path) -> Iterator[Path]:
    """The local scheduler on two cores with a 5 s retirement drain; answers its log."""
    with local_scheduler(database_url=database_url, redis_url=redis_url, home=home, settings={
            "SLUICE_CPU_CORES": "2", "SLUICE_RETIRE_DRAIN_S": str(DRAIN_S)}) as log_path:
        yield log_path


def queue(client: redis.Redis, model: str, count: int, *, timeout_s: float | None = None) -> list[str]:
    now = time.time()
    records = [JobRecord(id=new_job_id(model, VERSION), tenant="demo", model=model, version=VERSION, lane="online",
                         status=JobStatus.queued, input={"text": f"job {i}"}, enqueued_at=now, cost=2,
                         deadline=now + timeout_s if timeout_s else None)
               for i in range(count)]
    pipe = client.pipeline(transaction=False)
    queue_jobs(pipe, records, result_ttl_s=600)
    pipe.execute()
    return [record.id for record in records]


def live_workers(client: redis.Redis, model: str) -> int:
    return int(client.zcount(keys.live_workers(model, VERSION), live_since(time.time()), "+inf"))


def wait_for_live(client: redis.Redis, model: str, log_path: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while live_workers(client, model) < 1:
        assert time.monotonic() < deadline, f"{model} never got a worker:\n{log_path.read_text()[-3000:]}"
        time.sleep(0.2)


def retire(database_url: str, redis_url: str, model: str) -> None:
    """As `PATCH …/versions/v1 {"state": "retired"}` does: the registry, then the announcement."""
    registry = Registry(url=database_url, pool_size=1)
    try:
        with registry.session() as session:
            catalog.update_version(session, model=model, version=VERSION, actor="test", reason="retire under load",
                                   state="retired")
    finally:
        registry.dispose()

    async def announce() -> None:
        client = connections.connect(redis_url)
        try:
            await events.announce_routing(client, model)
        finally:
            await client.aclose()

    asyncio.run(announce())


def error_code(record: dict[str, str]) -> str | None:
    raw = record.get("error")
    return json.loads(raw).get("code") if raw else None


@pytest.mark.timeout(240)
def test_retiring_a_version_with_1000_queued_jobs_ends_every_job_within_the_drain_limit(
    redis_url: str, tmp_path: Path, figure: Callable[[str, object], None]
) -> None:
    model = f"retiring-{os.getpid()}"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with registry_with((model, SLOW, 1)) as database_url, scheduler(database_url, redis_url, tmp_path) as log_path:
        wait_for_live(client, model, log_path)
        ids = queue(client, model, JOBS)
        time.sleep(1.0)  # the worker is busy on them
        retire(database_url, redis_url, model)
        retired_at = time.monotonic()
        limit = DRAIN_S + 5
        while True:
            records = read_jobs(client, ids)
            open_ = [i for i, r in records.items() if r.get("status") in ("queued", "running")]
            if not open_ or time.monotonic() - retired_at > limit:
                break
            time.sleep(0.2)
        all_final_s = time.monotonic() - retired_at
        statuses = {(r.get("status"), error_code(r)) for r in records.values()}
        counts = {s: sum(1 for r in records.values() if (r.get("status"), error_code(r)) == s) for s in statuses}
        assert not open_, f"{len(open_)} jobs not final {limit} s after the retirement: {counts}"
        assert statuses <= {("succeeded", None), ("failed", "version_retired")}, counts
        assert counts.get(("failed", "version_retired")), f"the worker ran all of them within the drain: {counts}"
        assert counts.get(("succeeded", None)), f"the drain ran nothing: {counts}"
        # Nothing is left in the version's streams for a worker that will never come.
        assert all(lane_jobs(client, model, VERSION, lane) == 0 for lane in ("online", "bulk"))
    client.close()
    figure("all_final_after_retire_s", round(all_final_s, 2))
    figure("succeeded", counts.get(("succeeded", None), 0))
    figure("version_retired", counts.get(("failed", "version_retired"), 0))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("artifact, max_replicas", [(FAST, 0), (REFUSED, 1)], ids=["none_placed", "refused"])
def test_a_job_with_a_timeout_on_a_version_no_worker_serves_expires_in_time(
    redis_url: str, tmp_path: Path, artifact: str, max_replicas: int
) -> None:
    served, unserved = f"served-{os.getpid()}", f"unserved-{os.getpid()}-{max_replicas}"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with registry_with((served, FAST, 1), (unserved, artifact, max_replicas)) as database_url, \
            scheduler(database_url, redis_url, tmp_path) as log_path:
        wait_for_live(client, served, log_path)  # the scheduler and its processes are up
        [job] = queue(client, unserved, 1, timeout_s=30)
        queued_at = time.monotonic()
        while (status := read_jobs(client, [job])[job].get("status")) == "queued":
            assert time.monotonic() - queued_at < 35, f"still queued after 35 s:\n{log_path.read_text()[-3000:]}"
            time.sleep(0.2)
        assert status == "expired", read_jobs(client, [job])[job]
        assert time.monotonic() - queued_at >= 29, "expired before its timeout"
        assert live_workers(client, unserved) == 0
    client.close()
