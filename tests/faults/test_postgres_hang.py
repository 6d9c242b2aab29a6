"""Postgres that stops answering (every process of a private cluster SIGSTOPped) under a running API.

Unlike a Postgres that is down, a hung one refuses nothing: connections stay open, the kernel
acknowledges every byte, and without a bound a query waits forever, holding an API thread and a
pooled connection. With the serving registry's bounds, what needs Postgres answers 503 within the
statement timeout and a second, the routing cache notices (`stale`), `/readyz` reports Postgres
`unavailable` and the API `degraded` (still 200: the submissions go on), and submissions are
admitted on the cached routing table and key. Thawed, readiness is back to `ok` without a restart.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from sluice.settings import Settings
from tests.support import ApiServer, http_client, make_settings, register_synthetic_model

from ._support import PostgresServer, RedisServer, seed_tenants

pytestmark = [pytest.mark.slow, pytest.mark.soak]

COST = "fixed_s=0.001&per_item_s=0.0002&per_token_s=0.00001"
# statement timeout 1 s + 1 s before the client gives up on silence, + a reconnect's connect
# timeout (libpq waits at least 2 s), + the test's own slack.
BOUND_S = 8.0


def test_submissions_go_on_and_registry_reads_answer_503_while_postgres_hangs(
    private_postgres: PostgresServer, private_redis: RedisServer, tmp_path: Path,
    start_api: Callable[[Settings], ApiServer], figure: Callable[[str, object], None],
) -> None:
    seeded = seed_tenants(private_postgres.url, home=tmp_path)
    settings = make_settings(redis_url=private_redis.url, database_url=private_postgres.url, home=tmp_path,
                             routing_refresh_s=0.5, registry_statement_timeout_s=1.0,
                             registry_lock_timeout_s=0.5, registry_connect_timeout_s=1.0)
    api = start_api(settings)

    with http_client(api.url, seeded.admin_key, timeout_s=15) as admin, \
            http_client(api.url, seeded.demo_key, timeout_s=15) as demo:
        model = register_synthetic_model(admin, "pghang", cost=COST)
        response = demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": "before the hang"}})
        assert response.status_code == 202, response.text  # the key is cached, the model routed

        private_postgres.freeze()
        try:
            started = time.monotonic()
            # More registry reads at once than the pool has connections: each answers, none waits on.
            with ThreadPoolExecutor(max_workers=12) as pool:
                answers = list(pool.map(lambda _: _timed(demo, "/v1/models"), range(12)))
            for status, code, took in answers:
                assert (status, code) == (503, "registry_unavailable"), answers
                assert took < BOUND_S, answers
            figure("registry_read_503_within_s", round(max(took for _, _, took in answers), 2))

            stale_seen = False
            accepted = 0
            while time.monotonic() - started < 3.0 or not stale_seen:
                assert time.monotonic() - started < 30, "the routing cache never noticed the hang"
                response = demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": f"during {accepted}"}})
                assert response.status_code == 202, response.text
                accepted += 1
                ready = api.readyz()
                assert ready["_status_code"] == 200, ready
                assert ready["status"] == "degraded", ready
                assert ready["checks"]["postgres"] == "unavailable", ready
                stale_seen = ready["checks"]["routing"] == "stale"
                time.sleep(0.1)
            figure("accepted_while_postgres_hung", accepted)
            figure("routing_stale_after_s", round(time.monotonic() - started, 2))
        finally:
            private_postgres.thaw()

        ready = api.wait_ready("ok", timeout_s=30)
        assert ready["checks"]["postgres"] == "ok", ready
        response = demo.get("/v1/models")
        assert response.status_code == 200, response.text


def _timed(client: httpx.Client, path: str) -> tuple[int, str | None, float]:
    started = time.monotonic()
    try:
        response = client.get(path)
    except httpx.TimeoutException:
        return 0, "no answer", time.monotonic() - started
    code = response.json().get("error", {}).get("code") if response.status_code >= 400 else None
    return response.status_code, code, time.monotonic() - started
