"""Redis restarted under queued jobs (ARCHITECTURE, "Faults").

A redis-server of the test's own (append-only, fsync always) holds the queue. Jobs are accepted
while no worker runs, Redis is shut down and started again on the same port and directory, and
a worker started afterwards completes every accepted job. While Redis is down the API answers
503 with the error body and `Retry-After` on every route that needs it, never a 500, and
`/readyz` is 503.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from launch.seed import Seeded
from sluice.settings import Settings
from tests.support import (
    ApiServer,
    WorkerProcess,
    http_client,
    lane_jobs,
    make_settings,
    register_synthetic_model,
    wait_job,
)

from ._support import RedisServer

pytestmark = pytest.mark.slow

COST = "fixed_s=0.001&per_item_s=0.0002&per_token_s=0.00001"


def _assert_unavailable(response: httpx.Response) -> None:
    assert response.status_code == 503, (response.request.method, response.request.url, response.text)
    body = response.json()
    assert set(body) == {"error"}, body
    assert body["error"]["code"] == "broker_unavailable", body
    assert body["error"]["message"], body
    assert "Traceback" not in response.text
    retry_after = response.headers.get("Retry-After")
    assert retry_after is not None and int(retry_after) >= 1, dict(response.headers)


def test_every_accepted_job_survives_a_redis_restart(
    private_redis: RedisServer, database_url: str, seeded: Seeded, admin: httpx.Client, tmp_path: Path,
    start_api: Callable[[Settings], ApiServer], spawn: Callable[..., WorkerProcess],
    figure: Callable[[str, object], None],
) -> None:
    # The registry is the session's (routing and keys live there); only the queue is private.
    model = register_synthetic_model(admin, f"restart-{int(time.time() * 1000) % 10**8}", cost=COST)
    settings = make_settings(redis_url=private_redis.url, database_url=database_url, home=tmp_path)
    api = start_api(settings)

    with http_client(api.url, seeded.demo_key, timeout_s=30) as demo:
        accepted: list[str] = []
        for i in range(40):
            response = demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": f"single {i}"}})
            assert response.status_code == 202, response.text
            accepted.append(response.json()["id"])
        response = demo.post(f"/v1/models/{model}/jobs:bulk",
                             json={"inputs": [{"text": f"bulk {i}"} for i in range(200)], "lane": "bulk"})
        assert response.status_code == 202, response.text
        accepted += response.json()["ids"]
        response = demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": "keyed"}},
                             headers={"Idempotency-Key": "before-restart"})
        assert response.status_code == 202, response.text
        keyed = response.json()["id"]
        accepted.append(keyed)

        private_redis.stop()

        # Down: every route that needs Redis says so with a 503 and Retry-After, never a 500.
        _assert_unavailable(demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": "while down"}}))
        _assert_unavailable(demo.post(f"/v1/models/{model}/jobs:bulk", json={"inputs": [{"text": "down"}]}))
        _assert_unavailable(demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": "x"}},
                                      headers={"Idempotency-Key": "while-down"}))
        _assert_unavailable(demo.get(f"/v1/jobs/{accepted[0]}"))
        _assert_unavailable(demo.get(f"/v1/jobs/{accepted[0]}", params={"wait": 1}))
        _assert_unavailable(demo.get(f"/v1/jobs/{accepted[0]}/events"))
        _assert_unavailable(demo.delete(f"/v1/jobs/{accepted[0]}"))
        ready = api.readyz()
        assert ready["_status_code"] == 503, ready
        assert ready["status"] == "unready", ready
        assert ready["checks"]["redis"] == "unavailable", ready
        # Bad input is still refused for what it is before the queue is needed.
        assert demo.post(f"/v1/models/{model}/jobs", json={"input": {"nope": 1}}).status_code == 422

        private_redis.start()
        rds = private_redis.client()
        try:
            # The append-only file brought every accepted job back, record and stream entry.
            backlog = lane_jobs(rds, model, "v1", "online") + lane_jobs(rds, model, "v1", "bulk")
            assert backlog == len(accepted), (backlog, len(accepted))
            api.wait_ready("ok", timeout_s=30)

            # Up again: the API accepts at once, and the Idempotency-Key from before still replays.
            response = demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": "after restart"}})
            assert response.status_code == 202, response.text
            after = response.json()["id"]
            response = demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": "keyed"}},
                                 headers={"Idempotency-Key": "before-restart"})
            assert response.status_code == 202, response.text
            assert response.json()["id"] == keyed
            assert response.headers.get("Idempotent-Replayed") == "true"

            spawn(redis_url=private_redis.url, database_url=database_url, model=model)
            jobs = [wait_job(demo, job_id, timeout_s=60) for job_id in [*accepted, after]]
        finally:
            rds.close()

    statuses: dict[str, Any] = {}
    for job in jobs:
        statuses[job["status"]] = statuses.get(job["status"], 0) + 1
    figure("accepted_before_restart", len(accepted))
    figure("final_statuses", statuses)
    figure("redis_starts", private_redis.starts)
    assert statuses == {"succeeded": len(accepted) + 1}, statuses
