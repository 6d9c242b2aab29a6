"""A worker SIGKILLed in the middle of a 500-job run loses no job (ARCHITECTURE, "Taking over, only from the dead").

Worker A reads ahead (up to `prefetch_batches` batches) and claims what it reads (status
`running`, attempts 1), so at the kill it holds a batch on the model and several more in memory,
all unacknowledged. Worker B, started with a short `claim_after_s`, takes those entries over with
XAUTOCLAIM once they have been idle that long; the claim script re-runs `running` jobs and only
settles ones whose outcome was already stored. Every job must end `succeeded` with one outcome.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import redis

from sluice.wire import keys
from tests.support import lane_jobs

from ._support import read_jobs, wait_statuses

pytestmark = [pytest.mark.slow, pytest.mark.soak]

JOBS = 500
# 32 items cost 2 ms + 32 × 10 ms: about 0.33 s a batch, so the run takes about 5 s in all.
COST = "fixed_s=0.002&per_item_s=0.01&per_token_s=0.00002"


def test_sigkill_mid_batch_loses_no_job(
    new_tenant: Callable[..., tuple[str, httpx.Client]], register_synthetic: Callable[..., str],
    start_worker: Callable[..., Any], rds: redis.Redis, figure: Callable[[str, object], None],
) -> None:
    model = register_synthetic("kill", cost=COST, max_batch_size=32, max_wait_ms=10)
    _, client = new_tenant("kill")
    worker_a = start_worker(model)

    inputs = [{"text": f"job number {i}"} for i in range(JOBS)]
    response = client.post(f"/v1/models/{model}/jobs:bulk", json={"inputs": inputs})
    assert response.status_code == 202, response.text
    ids: list[str] = response.json()["ids"]
    assert len(ids) == len(set(ids)) == JOBS

    # Kill A once a few batches are stored but most of the run is still ahead.
    deadline = time.monotonic() + 30
    while True:
        statuses = [r.get("status") for r in read_jobs(rds, ids).values()]
        done = statuses.count("succeeded")
        if done >= 64:
            break
        assert worker_a.proc.poll() is None, worker_a.log()
        assert time.monotonic() < deadline, f"worker A finished only {done} jobs in 30 s:\n{worker_a.log()}"
        time.sleep(0.02)
    worker_a.proc.kill()
    worker_a.proc.wait(timeout=10)
    # Read again now that A is dead: it kept claiming between the poll above and the kill.
    statuses = [r.get("status") for r in read_jobs(rds, ids).values()]
    at_kill = {s: statuses.count(s) for s in set(statuses)}
    assert at_kill.get("succeeded", 0) < JOBS, f"the kill came too late to test anything: {at_kill}"
    assert at_kill.get("running", 0) > 0, f"nothing was in flight at the kill: {at_kill}"

    worker_b = start_worker(model, env={"SLUICE_CLAIM_AFTER_S": "2"})
    records = wait_statuses(rds, ids, timeout_s=90)

    by_status: dict[str, int] = {}
    for record in records.values():
        by_status[record.get("status", "missing")] = by_status.get(record.get("status", "missing"), 0) + 1
    lost = JOBS - by_status.get("succeeded", 0)
    attempts = [int(r.get("attempts") or 0) for r in records.values()]
    duplicated = sum(1 for a in attempts if a > 1)
    samples = int(rds.xlen(keys.stats(model, "v1")))
    dead = int(rds.xlen(keys.dead_stream(model, "v1")))
    figures = {
        "submitted": JOBS, "lost": lost, "duplicated_deliveries": duplicated, "max_attempts": max(attempts),
        "statuses_at_kill": at_kill, "final_statuses": by_status, "outcomes_stored": samples, "dead_lettered": dead,
    }
    for name, value in figures.items():
        figure(name, value)
    summary = json.dumps(figures, sort_keys=True)

    assert lost == 0, f"jobs lost or failed: {summary}"
    assert dead == 0, summary
    # Re-delivered: exactly the jobs A had claimed (read ahead or on the model) but not stored.
    assert duplicated == at_kill.get("running", 0), summary
    assert all(1 <= a <= 2 for a in attempts), summary
    for job_id, given in zip(ids, inputs, strict=True):
        record = records[job_id]
        assert json.loads(record["output"]) == {"echo": given}, (job_id, record)
        assert "error" not in record, (job_id, record)
    # One stored outcome per job: a job run twice would have left a second latency sample.
    assert samples == JOBS, f"outcomes stored {samples} times for {JOBS} jobs: {summary}"
    # Nothing left behind: every entry acknowledged and deleted from the stream.
    assert lane_jobs(rds, model, "v1", "bulk") == 0, summary
    assert rds.xpending(keys.stream(model, "v1", "bulk"), keys.GROUP)["pending"] == 0, summary
    assert "took over" in worker_b.log(20_000), worker_b.log()
