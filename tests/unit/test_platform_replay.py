"""The platform bench's same-plan baseline (bench/platform.py, `replay_batches`): it replays the
passes each worker ran, in the order it ran them, and nothing that did not succeed. Nothing here
measures a speed."""

from __future__ import annotations

from typing import Any

from bench.platform import replay_batches


def job(job_id: str, worker: str, started_at: float, status: str = "succeeded") -> dict[str, Any]:
    return {"id": job_id, "worker": worker, "started_at": started_at, "status": status}


def test_each_worker_replays_its_own_passes_in_the_order_it_ran_them() -> None:
    ids = ["a", "b", "c", "d", "e", "f"]
    jobs = [
        job("a", "w2", 5.0), job("b", "w1", 3.0), job("c", "w1", 1.0),
        job("d", "w1", 3.0), job("e", "w2", 5.0), job("f", "w2", 2.0),
    ]
    assert replay_batches(jobs, ids) == [[[2], [1, 3]], [[5], [0, 4]]]


def test_a_job_that_did_not_succeed_is_not_replayed() -> None:
    ids = ["a", "b", "c"]
    jobs = [job("a", "w1", 1.0), job("b", "w1", 1.0, status="failed"), job("c", "w1", 2.0, status="expired")]
    assert replay_batches(jobs, ids) == [[[0]]]
