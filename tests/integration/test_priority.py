"""Priority inside a lane, over the REST API with a real worker process: priority 0 goes ahead of a
priority-2 flood, and a priority-2 job under a priority-0 flood starts within the ageing bound."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow

# 5 ms a job, batches of up to 8 closed within 10 ms: one batch is 40 ms on the model.
COST = "fixed_s=0.0&per_item_s=0.005&per_token_s=0"
BATCH, WAIT_MS, AGEING_S = 8, 10.0, 1.0
# A busy 2-core runner's scheduling delays, on top of the promised bounds.
SLACK_S = 0.35


def _flood(client: httpx.Client, model: str, n: int, priority: int) -> list[str]:
    ids: list[str] = []
    for start in range(0, n, 400):
        response = client.post(f"/v1/models/{model}/jobs:bulk", json={
            "inputs": [{"text": f"flood {i}"} for i in range(start, min(n, start + 400))], "lane": "bulk",
            "priority": priority})
        assert response.status_code == 202, response.text
        ids += response.json()["ids"]
    return ids


def _single(client: httpx.Client, model: str, priority: int) -> str:
    response = client.post(f"/v1/models/{model}/jobs", json={"input": {"text": "single"}, "lane": "bulk",
                                                            "priority": priority})
    assert response.status_code == 202, response.text
    job_id: str = response.json()["id"]
    return job_id


def test_priority_zero_runs_ahead_of_a_priority_two_flood(
    demo: httpx.Client, register_synthetic: Callable[..., str], start_worker: Callable[..., Any],
    wait_jobs: Callable[..., list[dict[str, Any]]],
) -> None:
    model = register_synthetic("priority", cost=COST, max_batch_size=BATCH, max_wait_ms=WAIT_MS)
    start_worker(model, env={"SLUICE_PRIORITY_AGEING_S": "30"})
    flood = _flood(demo, model, 600, priority=2)  # 3 s of work
    time.sleep(0.3)
    urgent = []
    for _ in range(8):
        urgent.append(_single(demo, model, 0))
        time.sleep(0.1)
    jobs = wait_jobs(demo, urgent)
    assert all(job["status"] == "succeeded" and job["priority"] == 0 for job in jobs)
    waits = [job["timings"]["queue_wait_ms"] / 1000 for job in jobs]
    assert max(waits) <= WAIT_MS / 1000 + BATCH * 0.005 + SLACK_S, waits
    assert demo.get(f"/v1/jobs/{flood[-1]}").json()["status"] == "queued"  # the flood was still there
    assert demo.get(f"/v1/jobs/{flood[0]}").json()["priority"] == 2


def test_the_lowest_priority_starts_within_the_ageing_bound_under_a_flood(
    demo: httpx.Client, register_synthetic: Callable[..., str], start_worker: Callable[..., Any],
    wait_jobs: Callable[..., list[dict[str, Any]]],
) -> None:
    model = register_synthetic("ageing", cost=COST, max_batch_size=BATCH, max_wait_ms=WAIT_MS)
    start_worker(model, env={"SLUICE_PRIORITY_AGEING_S": str(AGEING_S)})
    flood = _flood(demo, model, 800, priority=0)  # 4 s of work
    time.sleep(0.2)
    low = _single(demo, model, 2)
    queued = demo.get(f"/v1/jobs/{low}").json()
    assert queued["status"] == "queued" and queued["queue_position"] >= 1, queued  # held behind the flood
    [job] = wait_jobs(demo, [low])
    assert job["status"] == "succeeded"
    wait_s = job["timings"]["queue_wait_ms"] / 1000
    assert wait_s <= AGEING_S + BATCH * 0.005 + SLACK_S, job["timings"]
    assert demo.get(f"/v1/jobs/{flood[-1]}").json()["status"] == "queued", "it ran after the flood, not aged"


def test_priority_is_optional_and_checked(demo: httpx.Client, register_synthetic: Callable[..., str]) -> None:
    model = register_synthetic("priority-check")
    response = demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": "x"}})
    assert response.status_code == 202 and demo.get(f"/v1/jobs/{response.json()['id']}").json()["priority"] == 1
    for bad in (-1, 3, "high", 1.5):
        response = demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": "x"}, "priority": bad})
        assert response.status_code == 422, (bad, response.text)
        assert "priority" in response.text
