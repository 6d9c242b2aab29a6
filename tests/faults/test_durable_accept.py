"""Durable accept (issue item 10): what a 202 promises when the store crashes.

The queue is a Valkey of the test's own with the configuration `sluice up` ships (append-only,
`appendfsync everysec`); the machine's redis-server 7.0 has no WAITAOF and stands for a store that
cannot keep the promise. The registry is the session's.

- Durable mode refuses, at start-up, a store that cannot confirm an fsync.
- A submission whose fsync is not confirmed gets 503 `not_durable`, and nothing of it stays queued.
- Under load, `kill -9` of the store, restart on its data: in durable mode every job answered 202
  is there again (record, and entry or place among the held jobs). Default mode's count is reported, not asserted: what
  it loses depends on timing, and a killed process (unlike a crashed host) leaves the page cache.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from launch.embedded import VALKEY_CONFIG
from sluice.settings import Settings
from sluice.vocabulary import LANES
from sluice.wire import keys
from sluice.wire.connections import connect
from sluice.wire.durability import DurabilityUnsupported, require_durable_store
from tests.redis_cluster import running_cluster
from tests.support import (
    ApiServer,
    http_client,
    lane_job_ids,
    make_settings,
    register_synthetic_model,
    serving,
    unique,
    wait_until,
)

from ._support import RedisServer, SubmissionLoad, valkey_server

pytestmark = pytest.mark.slow

LOAD_THREADS = 8


def _valkey(directory: Path) -> RedisServer:
    directory.mkdir()
    server = RedisServer(directory=directory, binary=valkey_server(), persistence=dict(VALKEY_CONFIG))
    server.start()
    return server


@pytest.fixture
def tenant(admin: httpx.Client) -> Callable[[str], httpx.Client]:
    """A tenant with limits far above the load here, and a client for it on a given API."""
    response = admin.post("/v1/tenants", json={"id": unique("durable"), "rate_limit_per_s": 1e6})
    assert response.status_code == 201, response.text
    secret = response.json()["key"]["secret"]
    return lambda url: http_client(url, secret, timeout_s=30)


def test_durable_mode_refuses_to_start_on_a_store_without_waitaof(
    private_redis: RedisServer,
    database_url: str,
    tmp_path: Path,
) -> None:
    async def check() -> None:
        client = connect(private_redis.url, max_connections=1)
        try:
            await require_durable_store(client, timeout_ms=1000)
        finally:
            await client.aclose()

    with pytest.raises(DurabilityUnsupported, match="WAITAOF"):
        asyncio.run(check())
    settings = make_settings(redis_url=private_redis.url, database_url=database_url, home=tmp_path, durable_accept=True)
    with pytest.raises(DurabilityUnsupported), TestClient(create_app(settings=settings)):
        pass
    # The same store serves the default mode.
    with TestClient(create_app(settings=settings.model_copy(update={"durable_accept": False}))) as client:
        assert client.get("/healthz").status_code == 200


def test_an_unconfirmed_fsync_answers_503_and_leaves_nothing_queued(
    admin: httpx.Client,
    tenant: Callable[[str], httpx.Client],
    database_url: str,
    tmp_path: Path,
    start_api: Callable[[Settings], ApiServer],
) -> None:
    store = _valkey(tmp_path / "valkey")
    try:
        model = register_synthetic_model(admin, unique("durable"))
        api = start_api(
            make_settings(redis_url=store.url, database_url=database_url, home=tmp_path, durable_accept=True)
        )
        rds = store.client()
        with tenant(api.url) as client, rds:
            url = f"/v1/models/{model}/jobs"
            first = client.post(url, json={"input": {"text": "fsynced"}})
            assert first.status_code == 202, first.text

            # AOF off at run time: WAITAOF can no longer confirm anything.
            rds.config_set("appendonly", "no")
            refused = client.post(url, json={"input": {"text": "not fsynced"}})
            bulk = client.post(f"{url}:bulk", json={"inputs": [{"text": f"bulk {i}"} for i in range(5)]})
            keyed = client.post(url, json={"input": {"text": "keyed"}}, headers={"Idempotency-Key": "k-1"})
            for response in (refused, bulk, keyed):
                assert response.status_code == 503, response.text
                assert response.json()["error"]["code"] == "not_durable", response.text
                assert int(response.headers["Retry-After"]) >= 1
            # Withdrawn: no record and no place in the quota; the entries stay for a worker to settle.
            tenant_id = str(rds.hget(keys.job(first.json()["id"]), "tenant"))
            assert sorted(rds.scan_iter(match="sluice:job:*")) == [keys.job(first.json()["id"])]
            assert rds.zrange(keys.queued_jobs(tenant_id), 0, -1) == [first.json()["id"]]

            rds.config_set("appendonly", "yes")
            deadline = time.monotonic() + 20
            while (again := client.post(url, json={"input": {"text": "fsynced again"}})).status_code != 202:
                assert again.status_code == 503 and time.monotonic() < deadline, again.text
                time.sleep(0.2)
            # The refused request's Idempotency-Key was freed: its retry runs it, it replays nothing.
            retried = client.post(url, json={"input": {"text": "keyed"}}, headers={"Idempotency-Key": "k-1"})
            assert retried.status_code == 202, retried.text
            assert "Idempotent-Replayed" not in retried.headers
            assert rds.exists(keys.job(retried.json()["id"]))
    finally:
        store.stop()


@pytest.mark.soak  # stores killed and restarted
def test_cache_hits_are_fsynced_like_any_accept_and_a_refused_key_replays_them(
    admin: httpx.Client,
    tenant: Callable[[str], httpx.Client],
    database_url: str,
    tmp_path: Path,
    start_api: Callable[[Settings], ApiServer],
) -> None:
    store = _valkey(tmp_path / "valkey")
    try:
        model = register_synthetic_model(admin, unique("durable-cache"))
        assert admin.patch(f"/v1/models/{model}/versions/v1", json={"cache_ttl_s": 60}).status_code == 200
        api = start_api(
            make_settings(redis_url=store.url, database_url=database_url, home=tmp_path, durable_accept=True)
        )
        rds = store.client()
        with tenant(api.url) as client, rds:
            url = f"/v1/models/{model}/jobs"
            asked = {"input": {"text": "asked before"}}
            miss = client.post(url, json=asked).json()
            # What its worker would store (there is none here).
            rds.set(str(rds.hget(keys.job(miss["id"]), "cache_key")), '{"echo":{"text":"asked before"}}', ex=60)
            hit = client.post(url, json=asked)
            assert hit.status_code == 202 and hit.json()["cache_hit"] is True, hit.text

            rds.config_set("appendonly", "no")
            mixed = client.post(f"{url}:bulk", json={"inputs": [asked["input"], {"text": "new"}], "lane": "online"})
            only_hits = client.post(url, json=asked, headers={"Idempotency-Key": "k-hit"})
            for response in (mixed, only_hits):
                assert response.status_code == 503 and response.json()["error"]["code"] == "not_durable", response.text
            # The miss of the mixed submission is withdrawn; answered jobs are final and stay.
            tenant_id = str(rds.hget(keys.job(miss["id"]), "tenant"))
            assert rds.zrange(keys.queued_jobs(tenant_id), 0, -1) == [miss["id"]]

            rds.config_set("appendonly", "yes")
            deadline = time.monotonic() + 20
            while (again := client.post(url, json=asked, headers={"Idempotency-Key": "k-hit"})).status_code != 202:
                assert again.status_code == 503 and time.monotonic() < deadline, again.text
                time.sleep(0.2)
            # Nothing was queued, so the key kept its jobs: the retry replays the hit.
            assert again.headers["Idempotent-Replayed"] == "true" and again.json()["cache_hit"] is True
    finally:
        store.stop()


def _crash_under_load(
    *, durable: bool, admin: httpx.Client, tenant: Callable[[str], httpx.Client], database_url: str, directory: Path
) -> dict[str, object]:
    """Load, `kill -9` of the store, restart on its data; count what the 202s promised."""
    directory.mkdir()
    store = _valkey(directory / "valkey")
    try:
        model = register_synthetic_model(admin, unique("crash"))
        settings = make_settings(redis_url=store.url, database_url=database_url, home=directory, durable_accept=durable)
        with serving(settings) as api:
            load = SubmissionLoad(lambda: tenant(api.url), f"/v1/models/{model}/jobs", threads=LOAD_THREADS)
            load.run(before_s=3.0, fault=store.kill, after_s=0.5)
        store.start()
        with store.client() as rds:
            pipe = rds.pipeline(transaction=False)
            for job_id in load.accepted:
                pipe.exists(keys.job(job_id))
            records = pipe.execute()
            entries = lane_job_ids(rds, model, "v1", "online")
    finally:
        store.stop()
    present = sum(1 for job_id, record in zip(load.accepted, records, strict=True) if record and job_id in entries)
    return {"accepted": len(load.accepted), "lost": len(load.accepted) - present, "refused": load.refused}


@pytest.mark.soak
def test_kill_9_of_the_store_under_load_loses_no_job_accepted_in_durable_mode(
    admin: httpx.Client,
    tenant: Callable[[str], httpx.Client],
    database_url: str,
    tmp_path: Path,
    figure: Callable[[str, object], None],
) -> None:
    durable = _crash_under_load(
        durable=True, admin=admin, tenant=tenant, database_url=database_url, directory=tmp_path / "durable"
    )
    default = _crash_under_load(
        durable=False, admin=admin, tenant=tenant, database_url=database_url, directory=tmp_path / "default"
    )
    for name, value in durable.items():
        figure(f"durable_{name}", value)
    for name, value in default.items():
        figure(f"default_{name}", value)
    assert durable["accepted"] > 100, durable  # the kill really came under load
    assert durable["lost"] == 0, durable


def test_on_a_valkey_cluster_the_fsync_wait_goes_to_the_node_that_wrote_the_jobs(
    admin: httpx.Client,
    tenant: Callable[[str], httpx.Client],
    database_url: str,
    tmp_path: Path,
) -> None:
    """WAITAOF names no key: on a cluster it must reach the node that wrote the jobs, or it confirms
    the fsync of a node that wrote nothing. That node, killed and restarted on its data, still
    holds every job answered 202."""
    with running_cluster(tmp_path / "cluster", binary=valkey_server()) as cluster:
        model = register_synthetic_model(admin, unique("durable-cluster"))
        settings = make_settings(redis_url=cluster.url, database_url=database_url, home=tmp_path, durable_accept=True)
        writer = cluster.node_of(keys.stream(model, "v1", "online"))
        with serving(settings) as api, tenant(api.url) as client:
            for node in cluster.nodes:  # start-up asked every node once
                with node.client() as rds:
                    rds.config_resetstat()
            url = f"/v1/models/{model}/jobs"
            single = client.post(url, json={"input": {"text": "one"}})
            bulk = client.post(f"{url}:bulk", json={"inputs": [{"text": f"bulk {i}"} for i in range(5)]})
            keyed = client.post(url, json={"input": {"text": "keyed"}}, headers={"Idempotency-Key": "k-1"})
        for response in (single, bulk, keyed):
            assert response.status_code == 202, response.text
        waits = []
        for node in cluster.nodes:
            with node.client() as rds:
                waits.append(int(rds.info("commandstats").get("cmdstat_waitaof", {}).get("calls", 0)))
        # At least one wait per submission (the first also waited before loading the script).
        assert waits[writer] >= 3 and sum(waits) == waits[writer], (writer, waits)

        ids = [single.json()["id"], *bulk.json()["ids"], keyed.json()["id"]]
        cluster.nodes[writer].kill()
        cluster.nodes[writer].start()
        wait_until(cluster.ready, timeout_s=30, what="the cluster after its node's restart")
        with cluster.client() as rds:
            assert all(rds.exists(keys.job(job_id)) for job_id in ids)
            entries = {job_id for lane in LANES for job_id in lane_job_ids(rds, model, "v1", lane)}
        assert entries == set(ids)
