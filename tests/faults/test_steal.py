"""Healthy workers whose batches outlast the claim threshold run every job exactly once.

Each worker reads ahead (up to `prefetch_batches` batches) and its model takes longer than
`claim_after_s` per batch, so entries wait in its hands for several times that threshold. Left
alone, XAUTOCLAIM's idle clock runs on while they wait: another worker takes them over, both
run them, each take-over counts an attempt, and after `max_deliveries` a healthy job is
dead-lettered. The workers run in this process over real Redis, on one handler that counts every
run of every input, so "exactly once" is measured rather than read off the job records.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import pytest
import redis.asyncio as aioredis

from sluice.kinds import ModelKind
from sluice.wire import keys
from sluice.wire.connections import connect
from tests.support import drive, lane_jobs_async, queue_in_redis, unique
from workers.models.protocol import ModelHandler
from workers.worker import Worker

JOBS = 500
CLAIM_AFTER_S = 1.0
# A batch of 32 takes 1.6 s, longer than the claim threshold: two workers need about 13 s, four 7 s.
BATCH_S = 1.6
BATCH = 32


class CountingHandler(ModelHandler):
    """Sleeps BATCH_S per batch, echoes, and counts every run of every input (by its text)."""

    kind = ModelKind.synthetic
    length_buckets = True

    def __init__(self) -> None:
        self.runs: Counter[str] = Counter()
        self._lock = threading.Lock()  # the workers' batches run on threads at once

    def warmup(self) -> None:
        """Nothing to warm."""

    def run(self, inputs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        with self._lock:
            self.runs.update(item["text"] for item in inputs)
        time.sleep(BATCH_S)
        return [{"echo": dict(item)} for item in inputs]


@pytest.fixture
async def aredis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = connect(redis_url, max_connections=16)
    yield client
    await client.aclose()


# Two workers: the case. Four: enough hands for one job to be taken over three times, which
# before the refresh dead-lettered healthy jobs.
@pytest.mark.parametrize("workers", [2, 4])
@pytest.mark.soak  # workers held past the claim threshold: seconds of waiting per case
async def test_entries_held_longer_than_the_claim_threshold_are_not_stolen(
    aredis: aioredis.Redis,
    figure: Callable[[str, object], None],
    workers: int,
) -> None:
    model = unique("steal")
    inputs = [{"text": f"job number {i}"} for i in range(JOBS)]
    ids = await queue_in_redis(aredis, model, inputs)
    handler = CountingHandler()
    pool = [
        Worker(
            redis=aredis,
            model=model,
            version="v1",
            handler=handler,
            max_batch_size=BATCH,
            max_wait_ms=10,
            claim_after_s=CLAIM_AFTER_S,
            max_deliveries=3,
            prefetch_batches=4,
            shutdown_grace_s=10,
            name=f"worker-{n}",
        )
        for n in range(workers)
    ]

    started = time.monotonic()
    records = await drive(pool, aredis, ids, timeout_s=120)
    elapsed = time.monotonic() - started

    runs = [handler.runs[given["text"]] for given in inputs]
    attempts = Counter(int(record.get("attempts") or 0) for record in records.values())
    statuses = Counter(record.get("status", "missing") for record in records.values())
    dead = await aredis.xlen(keys.dead_stream(model, "v1"))
    samples = await aredis.xlen(keys.stats(model, "v1"))
    figures: dict[str, object] = {
        "workers": workers,
        "jobs": JOBS,
        "runs_per_job_min": min(runs),
        "runs_per_job_max": max(runs),
        "jobs_run_more_than_once": sum(1 for n in runs if n > 1),
        "dead_lettered": dead,
        "attempts": dict(sorted(attempts.items())),
        "statuses": dict(statuses),
        "samples": samples,
        "seconds": round(elapsed, 1),
    }
    for name, value in figures.items():
        figure(name, value)
    summary = json.dumps(figures, sort_keys=True)

    assert runs == [1] * JOBS, summary
    assert dead == 0, summary
    assert attempts == {1: JOBS}, summary
    assert statuses == {"succeeded": JOBS}, summary
    assert samples == JOBS, summary
    for job_id, given in zip(ids, inputs, strict=True):
        assert json.loads(records[job_id]["output"]) == {"echo": given}, records[job_id]
    # Nothing left behind: every entry acknowledged and deleted.
    assert await lane_jobs_async(aredis, model, "v1", "online") == 0, summary
