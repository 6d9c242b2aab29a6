"""No job waits for a worker that will never come (ARCHITECTURE, "No job waits for a worker that
will never come"), through the scheduler's tick as its loop runs it, with no worker at all: a
queued job past its `timeout_s` is expired by the sweeper, its quota place freed; a retired
version keeps its placement while it drains, then what it still has fails with `version_retired`
and it leaves the plan."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import redis

from scheduler.main import Scheduler, autoscaler
from sluice.registry.store import Registry
from sluice.settings import Settings
from sluice.wire import keys, placements
from tests.support import wait_until


def scheduler(registry: Registry, redis_url: str, *, drain_s: float = 60.0) -> Scheduler:
    return Scheduler(registry=registry, redis_url=redis_url, supervisor=None, retire_drain_s=drain_s,
                     autoscaler=autoscaler(Settings(worker_slots=2)))


def statuses(rds: redis.Redis, ids: list[str]) -> list[str]:
    return [rds.hget(keys.job(job_id), "status") for job_id in ids]  # type: ignore[misc]


def test_a_queued_job_past_its_deadline_expires_without_a_worker(
    demo: httpx.Client, rds: redis.Redis, registry: Registry, redis_url: str,
    register_synthetic: Callable[..., str], seeded: object,
) -> None:
    model = register_synthetic("deadline")
    ids = [demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": f"t{i}"}, "timeout_s": 1}).json()["id"]
           for i in range(3)]
    patient = demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": "no deadline"}}).json()["id"]
    assert rds.zcard(keys.deadlines(model, "v1")) == 3
    runner = scheduler(registry, redis_url)
    runner.tick()
    assert statuses(rds, ids) == ["queued"] * 3, "expired before its deadline"
    time.sleep(1.2)
    runner.tick()
    assert statuses(rds, ids) == ["expired"] * 3 and statuses(rds, [patient]) == ["queued"]
    answer = demo.get(f"/v1/jobs/{ids[0]}").json()
    assert answer["error"]["code"] == "expired", answer
    # Their quota places are free again; the patient job still holds its own.
    assert not any(rds.zscore(keys.queued_jobs("demo"), job_id) for job_id in ids)
    assert rds.zscore(keys.queued_jobs("demo"), patient) is not None
    assert rds.zcard(keys.deadlines(model, "v1")) == 0


def test_a_retired_version_drains_then_fails_what_is_left_with_version_retired(
    demo: httpx.Client, admin: httpx.Client, rds: redis.Redis, registry: Registry, redis_url: str,
    register_synthetic: Callable[..., str],
) -> None:
    model = register_synthetic("retiring", versions=("v1", "v2"), weights={"v1": 100.0})
    # More than a batch's worth with no worker: past the first batch they are held beside the stream.
    ids = demo.post(f"/v1/models/{model}/jobs:bulk", json={"inputs": [{"text": f"r{i}"} for i in range(80)]},
                    ).json()["ids"]
    assert int(rds.hget(keys.held_index(model, "v1", "bulk"), "*") or 0) > 0  # type: ignore[arg-type]
    runner = scheduler(registry, redis_url, drain_s=1.0)
    runner.tick()
    assert admin.put(f"/v1/models/{model}/routing", json={"weights": {"v2": 100}}).status_code == 200
    assert admin.patch(f"/v1/models/{model}/versions/v1", json={"state": "retired"}).status_code == 200
    runner.tick()
    plan = placements.read(rds)
    assert plan is not None and plan.groups_of((model, "v1")), "a retired version with a queue stays placed"
    assert set(statuses(rds, ids)) == {"queued"}
    time.sleep(1.1)
    runner.tick()
    assert set(statuses(rds, ids)) == {"failed"}
    error = demo.get(f"/v1/jobs/{ids[0]}").json()["error"]
    assert error["code"] == "version_retired" and f"{model}/v1" in error["message"], error
    assert not any(rds.zscore(keys.queued_jobs("demo"), job_id) for job_id in ids)
    assert rds.exists(keys.stream(model, "v1", "bulk"), keys.held_index(model, "v1", "bulk")) == 0
    assert not list(rds.scan_iter(match=keys.held_queue_prefix(model, "v1", "bulk").replace("{", "[{]").replace(
        "}", "[}]") + "*"))
    # Its lanes' job numbers go with its streams (`sluice.queue_standing`).
    assert rds.exists(keys.queue_added(model, "v1"), keys.queue_read(model, "v1")) == 0
    runner.tick()
    plan = placements.read(rds)
    assert plan is not None and not plan.groups_of((model, "v1")), "a drained retired version leaves the plan"
    wait_until(lambda: demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": "x"}}).status_code == 202,
               timeout_s=5, what="the model's other version serving")
