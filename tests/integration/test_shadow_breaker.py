"""Shadow traffic and the circuit breaker, end to end through HTTP, real workers and Redis."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from launch.seed import Seeded
from sluice.settings import Settings
from tests.support import ApiServer


@pytest.mark.slow
def test_shadow_copies_run_on_the_shadow_version_and_are_never_returned(
    demo: httpx.Client, admin: httpx.Client, register_synthetic: Callable[..., str],
    start_worker: Callable[..., Any], wait_jobs: Callable[..., list[dict[str, Any]]],
) -> None:
    model = register_synthetic("shadow", versions=("v1", "v2"), weights={})
    response = admin.patch(f"/v1/models/{model}/versions/v2", json={"state": "shadow", "reason": "compare"})
    assert response.status_code == 200, response.text
    response = admin.put(f"/v1/models/{model}/routing", json={"weights": {"v1": 100, "v2": 100}, "reason": "t"})
    assert response.status_code == 200, response.text
    start_worker(model, "v1")
    start_worker(model, "v2")

    ids = demo.post(f"/v1/models/{model}/jobs:bulk",
                    json={"inputs": [{"text": f"text {i}"} for i in range(30)]}).json()["ids"]
    jobs = wait_jobs(demo, ids)
    assert {(job["status"], job["version"]) for job in jobs} == {("succeeded", "v1")}

    deadline = time.monotonic() + 30
    while True:
        shadow = admin.get(f"/v1/models/{model}/versions/v2/stats", params={"window_s": 600}).json()
        if shadow["count"] >= 30 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert shadow["count"] == 30, "every sampled job (weight 100 = all) is copied exactly once"
    assert shadow["quality"]["mean_agreement"] == 1.0
    assert shadow["quality"]["agreement_n"] == 30
    primary = admin.get(f"/v1/models/{model}/versions/v1/stats", params={"window_s": 600}).json()
    assert primary["count"] == 30
    assert primary["quality"]["output_size_mean"] > 0
    assert "agreement_n" not in primary["quality"]


@pytest.fixture
def breaker_api(settings: Settings) -> Iterator[httpx.Client]:
    """A second API replica whose breakers trip fast: 10 samples at 50 % errors, open for 5 s.

    Open long enough that the checks made while it is open cannot run into half-open on a loaded
    machine, where the next job routed to the version is its probe."""
    from api.app import create_app

    tuned = settings.model_copy(update={"breaker_min_samples": 10, "breaker_open_s": 5.0,
                                        "breaker_no_worker_grace_s": 3600.0})
    server = ApiServer(app=create_app(settings=tuned))
    server.start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            yield client
    finally:
        server.stop()


def _breaker_state(client: httpx.Client, model: str, version: str) -> str:
    body = client.get("/readyz").json()
    return str(body.get("breakers", {}).get(f"{model}/{version}", {}).get("state", "unknown"))


def _until(predicate: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


@pytest.mark.soak  # failures until the breaker opens, then its open period and a probe: about 14 s
@pytest.mark.slow
def test_a_failing_version_is_cut_off_and_readmitted_after_a_successful_probe(
    seeded: Seeded, breaker_api: httpx.Client, register_synthetic: Callable[..., str],
    start_worker: Callable[..., Any], wait_jobs: Callable[..., list[dict[str, Any]]],
) -> None:
    model = register_synthetic("breaker", versions=("v1", "v2"), weights={"v2": 100})
    start_worker(model, "v1")
    start_worker(model, "v2")
    breaker_api.headers["Authorization"] = f"Bearer {seeded.demo_key}"
    submit = f"/v1/models/{model}/jobs"

    ids = breaker_api.post(f"{submit}:bulk", json={"version": "v2",
                                                   "inputs": [{"text": "__poison__"}] * 12}).json()["ids"]
    assert {job["status"] for job in wait_jobs(breaker_api, ids)} == {"failed"}
    _until(lambda: _breaker_state(breaker_api, model, "v2") == "open")

    # Open: unpinned jobs go to stable; a caller naming the version is told which one and why.
    moved = breaker_api.post(submit, json={"input": {"text": "hello"}})
    assert moved.status_code == 202 and moved.json()["version"] == "v1"
    refused = breaker_api.post(submit, json={"input": {"text": "hello"}, "version": "v2"})
    assert refused.status_code == 503, refused.text
    assert "'v2'" in refused.json()["error"]["message"] and refused.headers["Retry-After"]

    # Half-open after 5 s: a probe reaches v2, succeeds, and the breaker closes.
    def probed() -> bool:
        job = breaker_api.post(submit, json={"input": {"text": "probe"}}).json()
        if job["version"] != "v2":
            return False
        wait_jobs(breaker_api, [job["id"]])
        return True

    _until(probed)
    _until(lambda: _breaker_state(breaker_api, model, "v2") == "closed")
    assert breaker_api.post(submit, json={"input": {"text": "back"}}).json()["version"] == "v2"
