"""Postgres stopped under a running API (ARCHITECTURE, "Faults").

The registry is a Postgres cluster of the test's own. Once the API has loaded its routing table
and seen a key, stopping Postgres must not stop submissions: they are admitted on the cached
routing table and the cached key, queued in Redis, and run by a worker that is already up.
`/readyz` says `degraded` (200, Postgres down, routing stale); registry reads answer 503, not 500.
With Postgres back, readiness returns to `ok` without a restart.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from api.app import create_app
from sluice.settings import Settings
from tests.support import (
    ApiServer,
    WorkerProcess,
    http_client,
    make_settings,
    record_failures,
    register_synthetic_model,
    wait_job,
    wait_until,
)

from ._support import PostgresServer, RedisServer, seed_tenants

pytestmark = [pytest.mark.slow, pytest.mark.soak]

COST = "fixed_s=0.001&per_item_s=0.0002&per_token_s=0.00001"


def test_submissions_continue_on_the_cached_routing_table_while_postgres_is_down(
    private_postgres: PostgresServer, private_redis: RedisServer, tmp_path: Path,
    start_api: Callable[[Settings], ApiServer], spawn: Callable[..., WorkerProcess],
    figure: Callable[[str, object], None], caplog: pytest.LogCaptureFixture,
) -> None:
    seeded = seed_tenants(private_postgres.url, home=tmp_path)
    # A short refresh period, so the routing cache notices the outage (and the recovery) quickly.
    settings = make_settings(redis_url=private_redis.url, database_url=private_postgres.url, home=tmp_path,
                             routing_refresh_s=0.5, auth_cache_s=1.0)
    api = start_api(settings)

    with http_client(api.url, seeded.admin_key) as admin, http_client(api.url, seeded.demo_key) as demo:
        model = register_synthetic_model(admin, "pgdown", cost=COST)
        spawn(redis_url=private_redis.url, database_url=private_postgres.url, model=model)
        # One authenticated request warms the key cache; the routing table is loaded already.
        response = demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": "before the outage"}})
        assert response.status_code == 202, response.text
        ids = [response.json()["id"]]

        caplog.set_level(logging.INFO)
        private_postgres.stop()
        started = time.monotonic()

        # Accepted at once, and still accepted once the routing cache has noticed and gone stale
        # and the key's cache entry has expired (auth_cache_s=1): both serve their last good answer.
        stale_seen = False
        statuses: dict[int, int] = {}
        while time.monotonic() - started < 3.0 or not stale_seen:
            assert time.monotonic() - started < 20, "the routing cache never noticed the outage"
            response = demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": f"during {len(ids)}"}})
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            assert response.status_code == 202, response.text
            ids.append(response.json()["id"])
            response = demo.post(f"/v1/models/{model}/jobs:bulk", json={"inputs": [{"text": "a"}, {"text": "b"}]})
            assert response.status_code == 202, response.text
            ids += response.json()["ids"]
            ready = api.readyz()
            assert ready["_status_code"] == 200, ready
            assert ready["status"] == "degraded", ready
            assert ready["checks"]["postgres"] == "unavailable", ready
            assert ready["checks"]["redis"] == "ok", ready
            stale_seen = stale_seen or ready["checks"]["routing"] == "stale"
            time.sleep(0.1)
        figure("accepted_while_postgres_down", len(ids) - 1)
        # The routing refresh failed every 0.5-2 s and said so once: no log flood.
        refresh_failures = [r for r in caplog.records if "routing reload failed" in r.getMessage()]
        assert len(refresh_failures) == 1, [r.getMessage() for r in refresh_failures]

        # Reading a job needs only Redis; the worker that was already up runs them all.
        jobs = [wait_job(demo, job_id, timeout_s=30) for job_id in ids]
        assert {job["status"] for job in jobs} == {"succeeded"}, [j["status"] for j in jobs]

        # What needs the registry says so: 503 with the error body, never a 500.
        response = demo.get("/v1/models")
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "registry_unavailable", response.text
        assert response.headers.get("Retry-After"), dict(response.headers)
        response = admin.put(f"/v1/models/{model}/routing", json={"weights": {"v1": 50.0}})
        assert response.status_code == 503, response.text
        # A key never seen before cannot be checked: 503, not 401 (it may be valid) and not 500.
        with http_client(api.url, "sk_never_seen_before_0123456789abcdef") as stranger:
            response = stranger.post(f"/v1/models/{model}/jobs", json={"input": {"text": "x"}})
        assert response.status_code == 503, response.text
        assert set(response.json()) == {"error"}, response.text

        private_postgres.start()
        recovered = time.monotonic()
        ready = api.wait_ready("ok", timeout_s=30)
        figure("readyz_ok_after_restart_s", round(time.monotonic() - recovered, 2))
        assert ready["checks"] == {"redis": "ok", "postgres": "ok", "routing": "ok", "events": "ok"}, ready
        response = demo.get("/v1/models")
        assert response.status_code == 200, response.text
        response = demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": "after the outage"}})
        assert response.status_code == 202, response.text
        assert wait_job(demo, response.json()["id"], timeout_s=30)["status"] == "succeeded"


def test_an_api_started_while_postgres_is_down_opens_breakers_once_it_is_back(
    private_postgres: PostgresServer, private_redis: RedisServer, tmp_path: Path,
) -> None:
    """With no routing table yet, the breakers' refresh has nothing to judge: it must wait for one,
    not end the task that keeps the breakers for the life of the process."""
    seeded = seed_tenants(private_postgres.url, home=tmp_path)
    private_postgres.stop()
    settings = make_settings(redis_url=private_redis.url, database_url=private_postgres.url, home=tmp_path,
                             routing_refresh_s=0.5, breaker_min_samples=5)
    api = ApiServer(app=create_app(settings=settings))
    api.start()
    try:
        assert api.readyz()["_status_code"] == 503
        time.sleep(2.5)  # the breakers' refresh runs every second, while there is no routing table
        private_postgres.start()
        api.wait_ready("ok", timeout_s=30)
        with http_client(api.url, seeded.admin_key) as admin:
            model = register_synthetic_model(admin, "late-breaker", cost=COST)
        with private_redis.client() as rds:
            record_failures(rds, model, "v1", 5)

        def state() -> str:
            return str(api.readyz().get("breakers", {}).get(f"{model}/v1", {}).get("state"))

        wait_until(lambda: state() == "open", timeout_s=10, what="the breaker to open")
    finally:
        api.stop()
