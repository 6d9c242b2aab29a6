"""A version no worker can serve (the placement plan's `not_served`: no placement possible, its
artifact refused) is refused at submission with 503 `not_served` and the reason, single and bulk,
nothing queued and no quota spent, instead of a 202 for a job no worker will ever take; the model's
other versions are unaffected, and a shadow copy to such a version is not made."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import pytest
import redis

from sluice.wire import keys, placements
from sluice.wire.placements import PlacementPlan
from tests.support import lane_jobs, wait_until


@pytest.fixture
def plan(rds: redis.Redis) -> Iterator[Callable[[dict[str, str]], None]]:
    """Publish a plan as the scheduler would; the one there before comes back after the test."""
    before = rds.get(keys.placements())

    def publish(not_served: dict[str, str]) -> None:
        placements.write(rds, PlacementPlan(at=0.0, not_served=not_served))

    yield publish
    if before is None:
        rds.delete(keys.placements())
    else:
        rds.set(keys.placements(), before)


def submit(client: httpx.Client, model: str, **body: object) -> httpx.Response:
    return client.post(f"/v1/models/{model}/jobs", json={"input": {"text": "hi"}, **body})


def test_a_version_no_worker_can_serve_answers_503_not_served_and_queues_nothing(
    demo: httpx.Client, admin: httpx.Client, rds: redis.Redis, register_synthetic: Callable[..., str],
    plan: Callable[[dict[str, str]], None],
) -> None:
    model = register_synthetic("unserved", versions=("v1", "v2"), weights={"v1": 100.0})
    reason = "its artifact was refused: sha256 mismatch"
    plan({f"{model}/v1": reason})
    wait_until(lambda: submit(demo, model).status_code == 503, timeout_s=5, what="the API reading the plan")
    queued = [lane_jobs(rds, model, "v1", lane) for lane in ("online", "bulk")]
    refused = submit(demo, model)
    assert refused.json()["error"]["code"] == "not_served" and reason in refused.json()["error"]["message"]
    assert refused.headers["Retry-After"] == "30"
    bulk = demo.post(f"/v1/models/{model}/jobs:bulk", json={"inputs": [{"text": "a"}, {"text": "b"}]})
    assert bulk.status_code == 503 and bulk.json()["error"]["code"] == "not_served"
    assert [lane_jobs(rds, model, "v1", lane) for lane in ("online", "bulk")] == queued, "a refusal queued"
    batch = demo.post("/v1/batches", json={"model": model, "inputs": [{"text": "a"}]})
    assert batch.status_code == 503 and batch.json()["error"]["code"] == "not_served", batch.text
    # Another version of the model, named by an admin, is served as usual.
    assert submit(admin, model, version="v2").status_code == 202
    plan({})
    wait_until(lambda: submit(demo, model).status_code == 202, timeout_s=5, what="the version served again")


def test_no_shadow_copy_goes_to_a_shadow_version_no_worker_can_serve(
    demo: httpx.Client, admin: httpx.Client, rds: redis.Redis, register_synthetic: Callable[..., str],
    plan: Callable[[dict[str, str]], None],
) -> None:
    model = register_synthetic("unserved-shadow", versions=("v1", "v2"), weights={"v1": 100.0})
    assert admin.patch(f"/v1/models/{model}/versions/v2", json={"state": "shadow"}).status_code == 200
    assert admin.put(f"/v1/models/{model}/routing", json={"weights": {"v1": 100, "v2": 100}}).status_code == 200
    assert submit(demo, model).status_code == 202
    assert last_entry(rds, model).get("sh") == "v2", "while v2 is served, every job is copied to it"
    plan({f"{model}/v2": "no process has room for it"})
    wait_until(lambda: submit(admin, model, version="v2").status_code == 503, timeout_s=5,
               what="the API reading the plan")
    for _ in range(5):
        assert submit(demo, model).status_code == 202
        # The copy is queued when v1's worker finishes the job; its stream entry names none.
        assert "sh" not in last_entry(rds, model), "a copy is due to v2"


def last_entry(rds: redis.Redis, model: str) -> dict[str, str]:
    [(_, fields)] = rds.xrevrange(keys.stream(model, "v1", "online"), count=1)  # type: ignore[misc]
    return fields  # type: ignore[return-value]
