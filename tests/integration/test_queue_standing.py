"""Where a queued job stands, over the REST API: `queue_position` and `estimated_start_s` on the job
resource, in the many-job wait and as `position` events of the job's stream."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import httpx
import pytest

from sluice.wire.heartbeats import BEAT_EVERY_S
from tests.support import sse_events

pytestmark = pytest.mark.slow


def _bulk(client: httpx.Client, model: str, n: int, *, lane: str = "online") -> list[str]:
    response = client.post(f"/v1/models/{model}/jobs:bulk",
                           json={"inputs": [{"text": f"job {i}"} for i in range(n)], "lane": lane})
    assert response.status_code == 202, response.text
    ids: list[str] = response.json()["ids"]
    return ids


def _queued(client: httpx.Client, ids: list[str]) -> dict[str, dict[str, Any]]:
    response = client.get("/v1/jobs", params={"ids": ",".join(ids)})
    assert response.status_code == 200, response.text
    return {entry["id"]: entry for entry in response.json().get("queued", [])}


def _assert_estimates_hold(standings: dict[str, dict[str, Any]], jobs: dict[str, dict[str, Any]],
                           read_at: float) -> None:
    """At least 90 % of the jobs read queued at `read_at` started within 2x of their estimate."""
    ratios = []
    for job_id, entry in standings.items():
        started = datetime.fromisoformat(jobs[job_id]["timings"]["started_at"]).timestamp() - read_at
        assert entry["estimated_start_s"] is not None
        ratios.append(max(started, 0.05) / max(entry["estimated_start_s"], 0.05))
    within = sum(1 for ratio in ratios if 0.5 <= ratio <= 2.0) / len(ratios)
    assert within >= 0.9, (f"estimated start within 2x of the observed one for {within:.0%} of {len(ratios)} "
                           f"jobs; observed / estimated median {statistics.median(ratios):.2f}")


def test_queued_jobs_stand_in_the_order_they_were_queued_per_lane(
    demo: httpx.Client, register_synthetic: Callable[..., str], new_tenant: Callable[..., tuple[str, httpx.Client]]
) -> None:
    model = register_synthetic("standing")  # no worker: everything stays queued
    online = _bulk(demo, model, 200)
    bulk = _bulk(demo, model, 5, lane="bulk")
    standing = _queued(demo, online)
    assert [standing[job_id]["queue_position"] for job_id in online] == list(range(200))
    assert all(entry["estimated_start_s"] is None for entry in standing.values())  # no live worker
    one = demo.get(f"/v1/jobs/{online[17]}").json()
    assert one["status"] == "queued" and one["queue_position"] == 17 and one["estimated_start_s"] is None
    # The bulk lane counts its own jobs; the online lane's backlog only delays its estimate.
    assert [_queued(demo, bulk)[job_id]["queue_position"] for job_id in bulk] == list(range(5))
    # Another tenant's job stands nowhere for this one: it does not exist.
    _, other = new_tenant("standing")
    assert other.get(f"/v1/jobs/{online[17]}").status_code == 404
    assert _queued(other, online[:3]) == {}


def test_positions_fall_as_a_worker_reads_and_the_estimates_hold(
    demo: httpx.Client, register_synthetic: Callable[..., str], start_worker: Callable[..., Any],
    wait_jobs: Callable[..., list[dict[str, Any]]],
) -> None:
    # 5 ms a job, in batches of up to 4: about 200 jobs a second, a queue of 200 lasts about a second.
    model = register_synthetic("standing", cost="fixed_s=0.0&per_item_s=0.005&per_token_s=0", max_batch_size=4,
                               max_wait_ms=1.0)
    start_worker(model)
    wait_jobs(demo, _bulk(demo, model, 40))
    time.sleep(BEAT_EVERY_S + 0.5)  # its measured service rate in the next heartbeat
    ids = _bulk(demo, model, 200)
    read_at = time.time()
    first = _queued(demo, ids)
    seen = {job_id: entry["queue_position"] for job_id, entry in first.items()}
    assert len(set(seen.values())) == len(seen), "two queued jobs of one lane share a place"
    while True:
        now = _queued(demo, ids)
        for job_id, entry in now.items():
            assert entry["queue_position"] <= seen[job_id], (job_id, entry, seen[job_id])
            seen[job_id] = entry["queue_position"]
        if not now:
            break
        time.sleep(0.05)
    jobs = {job["id"]: job for job in wait_jobs(demo, ids)}
    assert all(job["status"] == "succeeded" for job in jobs.values())
    _assert_estimates_hold(first, jobs, read_at)


def test_an_event_stream_shows_a_queued_jobs_place_falling(
    demo: httpx.Client, register_synthetic: Callable[..., str], start_worker: Callable[..., Any],
) -> None:
    model = register_synthetic("standing", cost="fixed_s=0.0&per_item_s=0.08&per_token_s=0", max_batch_size=2,
                               max_wait_ms=1.0)
    ids = _bulk(demo, model, 60)
    positions: list[int] = []
    names: list[str] = []
    with demo.stream("GET", f"/v1/jobs/{ids[-1]}/events", timeout=60) as response:
        for _, name, data in sse_events(response):
            names.append(name)
            if "queue_position" in data:
                positions.append(data["queue_position"])
            if len(names) == 1:
                start_worker(model)  # the stream is open: now let the queue move
    assert names[0] == "queued" and names[-1] == "succeeded", names
    assert "position" in names
    assert positions[0] == 59 and positions == sorted(positions, reverse=True) and len(set(positions)) >= 3


@pytest.mark.soak  # 45 passes of 100 ms one after another, then a backlog of 1,500: about 15 s
def test_the_estimate_divides_by_the_rate_a_backlog_drains_at_not_that_of_single_jobs(
    demo: httpx.Client, register_synthetic: Callable[..., str], start_worker: Callable[..., Any],
    wait_jobs: Callable[..., list[dict[str, Any]]],
) -> None:
    # 100 ms a pass and 0.5 ms a job: alone 10 jobs a second, in passes of 32 (the bulk lane's
    # read) about 275. The worker's recent passes are mostly of one job when the backlog comes.
    model = register_synthetic("standing", cost="fixed_s=0.1&per_item_s=0.0005&per_token_s=0", max_batch_size=32,
                               max_wait_ms=1.0)
    start_worker(model)
    for _ in range(45):
        wait_jobs(demo, _bulk(demo, model, 1))
    ids = [job_id for _ in range(3) for job_id in _bulk(demo, model, 500, lane="bulk")]
    time.sleep(BEAT_EVERY_S + 0.5)  # a heartbeat after some of the backlog's passes
    read_at = time.time()
    first = _queued(demo, ids[::6])  # a many-job wait names at most 256
    assert len(first) >= 50, "the backlog drained before its standings were read"
    _assert_estimates_hold(first, {job["id"]: job for job in wait_jobs(demo, list(first))}, read_at)
