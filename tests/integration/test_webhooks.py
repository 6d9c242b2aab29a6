"""Webhooks end to end: real Redis and Postgres, the in-process API, a real `sluice
worker`, a real Celery worker process (`celery -A workers.tasks worker --beat`) and a real HTTP
receiver on 127.0.0.1.

The Celery worker and an API replica allow 127.0.0.0/8 through settings, as an on-premise
deployment would; the suite's shared API allows nothing, so there a loopback callback is refused.
The relay tests at the top drive `OutboxRelay` directly and run before the module's Celery worker
(whose own relay would otherwise read the same outbox) is started.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import redis

from launch.seed import Seeded
from sluice.errors import BrokerUnavailable
from sluice.registry import tenants
from sluice.registry.store import Registry
from sluice.settings import Settings
from sluice.webhooks import verify
from sluice.wire import keys, scripts
from sluice.wire.connections import connect
from sluice.wire.jobs import JobRecord, JobStatus
from sluice.wire.keys import new_job_id
from sluice_client import verify as receiver_verify
from tests.support import (
    ApiServer,
    CeleryWorker,
    Received,
    Receiver,
    celery_worker_env,
    celery_worker_process,
    claim_one,
    finish_one_call,
    http_client,
    receiving,
    serving,
    spawn_worker,
    wait_until,
)
from workers.outbox import OutboxRelay

pytestmark = pytest.mark.slow

MAX_ATTEMPTS = 3
BACKOFF_BASE_S = 0.2
BACKOFF_CAP_S = 0.5
SWEEP_S = 1.0
CLAIM_AFTER_S = 2.0


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with receiving() as state:
        yield state


# --- the platform around it --------------------------------------------------------------------------


@dataclass
class Tenant:
    id: str
    client: httpx.Client
    webhook_secret: str


@pytest.fixture(scope="module")
def hooks_api(settings: Settings, seeded: Seeded) -> Iterator[ApiServer]:
    """An API replica that lets callbacks reach 127.0.0.0/8."""
    with serving(settings.model_copy(update={"webhook_allowed_networks": ["127.0.0.0/8"]})) as server:
        yield server


@pytest.fixture(scope="module")
def tenant(hooks_api: ApiServer, admin: httpx.Client) -> Iterator[Tenant]:
    response = admin.post("/v1/tenants", json={"id": f"hooks-{secrets.token_hex(3)}"})
    assert response.status_code == 201, response.text
    body = response.json()
    assert body["webhook_secret"], body
    with http_client(hooks_api.url, body["key"]["secret"]) as client:
        yield Tenant(id=body["id"], client=client, webhook_secret=body["webhook_secret"])


@pytest.fixture(scope="module")
def model(register_synthetic: Callable[..., str], hooks_api: ApiServer, redis_url: str, database_url: str,
          home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A synthetic model with one `sluice worker` serving it."""
    name = register_synthetic("hooks", max_wait_ms=5.0)
    hooks_api.reload_routing()
    worker = spawn_worker(redis_url=redis_url, database_url=database_url, home=home, model=name,
                          log_path=tmp_path_factory.mktemp("worker") / "worker.log")
    yield name
    assert worker.terminate() == 0, worker.log()


@pytest.fixture(scope="module")
def celery_worker(redis_url: str, database_url: str, home: Path, seeded: Seeded,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[CeleryWorker]:
    """`celery -A workers.tasks worker --beat` with fast retries and a one-second sweep."""
    env = celery_worker_env(
        redis_url=redis_url, database_url=database_url, home=home,
        SLUICE_WEBHOOK_MAX_ATTEMPTS=str(MAX_ATTEMPTS), SLUICE_WEBHOOK_BACKOFF_BASE_S=str(BACKOFF_BASE_S),
        SLUICE_WEBHOOK_BACKOFF_CAP_S=str(BACKOFF_CAP_S), SLUICE_WEBHOOK_SWEEP_S=str(SWEEP_S),
        SLUICE_WEBHOOK_TIMEOUT_S="3", SLUICE_CLAIM_AFTER_S=str(CLAIM_AFTER_S),
    )
    log_path = tmp_path_factory.mktemp("celery") / "celery.log"
    with celery_worker_process(env, log_path=log_path, name="webhooks") as worker:
        yield worker
    assert worker.proc.returncode == 0, worker.log()[-4000:]
    assert "Traceback" not in worker.log(), worker.log()[-4000:]


def delivery_state(rds: redis.Redis, delivery_id: str) -> dict[str, str]:
    return rds.hgetall(keys.delivery(delivery_id))  # type: ignore[return-value]


def wait_delivery(rds: redis.Redis, delivery_id: str, status: str, *, timeout_s: float = 30.0) -> dict[str, str]:
    wait_until(lambda: delivery_state(rds, delivery_id).get("status") == status, timeout_s=timeout_s,
               what=f"delivery {delivery_id} {status}")
    return delivery_state(rds, delivery_id)


def submit(tenant: Tenant, model: str, callback_url: str) -> str:
    response = tenant.client.post(f"/v1/models/{model}/jobs",
                                  json={"input": {"text": "hello hooks"}, "callback_url": callback_url})
    assert response.status_code == 202, response.text
    job_id: str = response.json()["id"]
    return job_id


def finished(tenant: Tenant, job_id: str) -> dict[str, Any]:
    response = tenant.client.get(f"/v1/jobs/{job_id}", params={"wait": 30})
    assert response.status_code == 200 and response.json()["status"] == "succeeded", response.text
    body: dict[str, Any] = response.json()
    return body


# --- the relay on its own (before the Celery worker exists) -----------------------------------------


def _outbox_pending(rds: redis.Redis, outbox: str = keys.WEBHOOK_OUTBOX) -> int:
    return int(rds.xpending(outbox, keys.RELAY_GROUP)["pending"])  # type: ignore[index]


def _has_relay_group(rds: redis.Redis, outbox: str) -> bool:
    """A relay reads the outbox: it found it in `keys.WEBHOOK_OUTBOXES` (a worker of its version
    put it there) and made its group."""
    return bool(rds.exists(outbox)) and any(g["name"] == keys.RELAY_GROUP for g in rds.xinfo_groups(outbox))  # type: ignore[union-attr]


async def test_the_relay_acks_only_what_it_published_and_republishes_the_rest(
    redis_url: str, rds: redis.Redis
) -> None:
    # Only the shared outbox: version outboxes other tests left entries on are not this relay's to read.
    rds.delete(keys.WEBHOOK_OUTBOX, keys.WEBHOOK_OUTBOXES)
    published: list[tuple[str, str]] = []
    broken = True

    def publish(delivery_id: str, job_id: str) -> None:
        if broken:
            raise BrokerUnavailable("the Celery broker is down")
        published.append((delivery_id, job_id))

    client = connect(redis_url, max_connections=2)
    try:
        relay = OutboxRelay(redis=client, publish=publish, claim_after_s=60)
        await relay.ensure_group()
        for n in range(3):
            rds.xadd(keys.WEBHOOK_OUTBOX, {"delivery": f"dlv_{n}", "job": f"job_{n}"})
        with pytest.raises(BrokerUnavailable):
            await relay.relay_once(block=False)
        assert published == [] and _outbox_pending(rds) == 3 and rds.xlen(keys.WEBHOOK_OUTBOX) == 3
        broken = False
        assert await relay.relay_once(block=False) == 3
        assert published == [(f"dlv_{n}", f"job_{n}") for n in range(3)]
        assert _outbox_pending(rds) == 0 and rds.xlen(keys.WEBHOOK_OUTBOX) == 0
    finally:
        await client.aclose()


async def test_a_live_relay_takes_over_what_a_dead_one_left_pending(redis_url: str, rds: redis.Redis) -> None:
    # Only the shared outbox: version outboxes other tests left entries on are not this relay's to read.
    rds.delete(keys.WEBHOOK_OUTBOX, keys.WEBHOOK_OUTBOXES)
    published: list[str] = []
    client = connect(redis_url, max_connections=2)
    try:
        alive = OutboxRelay(redis=client, publish=lambda d, _: published.append(d), claim_after_s=0.3)
        await alive.ensure_group()
        assert await alive.relay_once(block=False) == 0  # its first claim round, on an empty outbox
        rds.xadd(keys.WEBHOOK_OUTBOX, {"delivery": "dlv_orphan", "job": "job_orphan"})
        # A relay reads the entry and dies before publishing it.
        assert rds.xreadgroup(keys.RELAY_GROUP, "relay-dead", {keys.WEBHOOK_OUTBOX: ">"}, count=10)
        assert await alive.relay_once(block=False) == 0  # not idle long enough to take over yet
        await asyncio.sleep(0.4)
        assert await alive.relay_once(block=False) == 1
        assert published == ["dlv_orphan"] and _outbox_pending(rds) == 0
    finally:
        await client.aclose()


# --- refused at submit time ---------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["receiver", "http://localhost:8080/hook", "http://10.1.2.3/hook",
                                    "http://169.254.169.254/latest/meta-data", "http://[::1]:9000/hook",
                                    "http://2130706433/hook"])
def test_a_private_callback_is_refused_with_422_and_nothing_is_queued(
    demo: httpx.Client, receiver: Receiver, register_synthetic: Callable[..., str],
    queue_state: Callable[[str, str], Any], target: str,
) -> None:
    """The suite's API allows no network: 422 invalid_input, for one job and for a bulk."""
    name = register_synthetic("refused")
    url = f"{receiver.url}/refused" if target == "receiver" else target
    before = queue_state(name, "v1")
    single = demo.post(f"/v1/models/{name}/jobs", json={"input": {"text": "a"}, "callback_url": url})
    bulk = demo.post(f"/v1/models/{name}/jobs:bulk", json={"inputs": [{"text": "a"}], "callback_url": url})
    for response in (single, bulk):
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["code"] == "invalid_input", error
        assert "SLUICE_WEBHOOK_ALLOWED_NETWORKS" in error["message"], error
    assert queue_state(name, "v1") == before
    assert receiver.received("/refused") == []


def test_a_callback_scheme_other_than_http_is_refused(demo: httpx.Client,
                                                      register_synthetic: Callable[..., str]) -> None:
    name = register_synthetic("scheme")
    response = demo.post(f"/v1/models/{name}/jobs",
                         json={"input": {"text": "a"}, "callback_url": "ftp://example.com/hook"})
    assert response.status_code == 422, response.text


# --- delivery --------------------------------------------------------------------------------------------


def test_a_finished_job_is_posted_once_signed_with_the_tenant_secret(
    celery_worker: CeleryWorker, receiver: Receiver, tenant: Tenant, model: str, rds: redis.Redis,
    registry: Registry,
) -> None:
    job_id = submit(tenant, model, receiver.plan("/signed", 200) + "?token=abc")
    resource = finished(tenant, job_id)
    [request] = receiver.wait_for("/signed", 1)
    delivery_id = rds.hget(keys.job(job_id), "delivery_id")
    assert delivery_id and delivery_id.startswith("dlv_")  # type: ignore[union-attr]
    assert request.headers["sluice-delivery"] == delivery_id
    assert request.headers["content-type"] == "application/json"
    assert request.headers["host"] == urlsplit(receiver.url).netloc
    signature = request.headers["sluice-signature"]
    assert verify(tenant.webhook_secret, signature, request.body)
    # The Standard Webhooks headers: the delivery id as the message id, signed with the same secret.
    assert request.headers["webhook-id"] == delivery_id
    assert request.headers["webhook-timestamp"] == signature.split(",")[0].removeprefix("t=")
    assert receiver_verify(tenant.webhook_secret, standard_headers(request), request.body)
    assert receiver_verify(tenant.webhook_secret, request.headers, request.body)  # every form at once
    with registry.session() as session:
        demo_secret = tenants.tenant_secret(session, "demo")
    assert demo_secret and not verify(demo_secret, signature, request.body)
    assert not receiver_verify(demo_secret, standard_headers(request), request.body)
    assert json.loads(request.body) == resource  # the same JSON as GET /v1/jobs/{id}
    state = wait_delivery(rds, str(delivery_id), "delivered")
    assert state["attempts"] == "1" and state["job"] == job_id and state["last_status"] == "200"
    assert rds.zscore(keys.WEBHOOK_DUE, str(delivery_id)) is None


def standard_headers(request: Received) -> dict[str, str]:
    return {name: request.headers[name] for name in ("webhook-id", "webhook-timestamp", "webhook-signature")}


def test_a_rotated_secret_and_the_one_it_replaced_both_sign_the_delivery(
    celery_worker: CeleryWorker, receiver: Receiver, hooks_api: ApiServer, admin: httpx.Client, model: str,
    registry: Registry,
) -> None:
    """Rotated over REST before the tenant's first delivery (so no delivery worker holds its
    secrets yet): each of the two secrets verifies every header on its own, and no other tenant's
    secret verifies any."""
    created = admin.post("/v1/tenants", json={"id": f"rotating-{secrets.token_hex(3)}"})
    assert created.status_code == 201, created.text
    old = created.json()["webhook_secret"]
    rotated = admin.post(f"/v1/tenants/{created.json()['id']}/webhook-secret:rotate", json={"overlap_s": 600})
    assert rotated.status_code == 200, rotated.text
    new = rotated.json()["webhook_secret"]
    with http_client(hooks_api.url, created.json()["key"]["secret"]) as client:
        rotating = Tenant(id=created.json()["id"], client=client, webhook_secret=new)
        finished(rotating, submit(rotating, model, receiver.plan("/rotating", 500, 200)))
        requests = receiver.wait_for("/rotating", 2)
    with registry.session() as session:
        demo_secret = tenants.tenant_secret(session, "demo")
    assert demo_secret
    assert requests[0].headers["webhook-id"] == requests[1].headers["webhook-id"]  # stable across the retry
    for request in requests:
        assert request.headers["webhook-signature"].count("v1,") == 2
        assert receiver_verify(new, request.headers, request.body)
        assert receiver_verify(old, request.headers, request.body)
        assert receiver_verify(old, standard_headers(request), request.body)
        assert receiver_verify(new, request.headers["sluice-signature"], request.body)
        assert not receiver_verify(demo_secret, standard_headers(request), request.body)
        assert not receiver_verify(demo_secret, request.headers["sluice-signature"], request.body)


def test_a_5xx_is_retried_with_backoff_and_the_same_delivery_id(
    celery_worker: CeleryWorker, receiver: Receiver, tenant: Tenant, model: str, rds: redis.Redis,
) -> None:
    job_id = submit(tenant, model, receiver.plan("/flaky", 500, 503, 200))
    finished(tenant, job_id)
    requests = receiver.wait_for("/flaky", 3)
    delivery_id = str(rds.hget(keys.job(job_id), "delivery_id"))
    assert {r.headers["sluice-delivery"] for r in requests} == {delivery_id}
    assert {r.headers["webhook-id"] for r in requests} == {delivery_id}
    assert all(receiver_verify(tenant.webhook_secret, r.headers, r.body) for r in requests)
    assert all(verify(tenant.webhook_secret, r.headers["sluice-signature"], r.body) for r in requests)
    # Backoff with equal jitter waits at least half of each step: 0.1 s, then 0.2 s.
    assert requests[1].at - requests[0].at >= BACKOFF_BASE_S / 2
    assert requests[2].at - requests[1].at >= BACKOFF_BASE_S
    state = wait_delivery(rds, delivery_id, "delivered")
    assert state["attempts"] == "3"
    time.sleep(BACKOFF_CAP_S * 3)
    assert len(receiver.received("/flaky")) == 3


def test_a_4xx_is_not_retried(
    celery_worker: CeleryWorker, receiver: Receiver, tenant: Tenant, model: str, rds: redis.Redis,
) -> None:
    job_id = submit(tenant, model, receiver.plan("/gone", 410, 200))
    finished(tenant, job_id)
    receiver.wait_for("/gone", 1)
    state = wait_delivery(rds, str(rds.hget(keys.job(job_id), "delivery_id")), "failed")
    assert state["attempts"] == "1" and state["last_status"] == "410"
    time.sleep(BACKOFF_CAP_S * 3)
    assert len(receiver.received("/gone")) == 1


def test_after_the_last_attempt_the_delivery_is_recorded_failed(
    celery_worker: CeleryWorker, receiver: Receiver, tenant: Tenant, model: str, rds: redis.Redis,
) -> None:
    job_id = submit(tenant, model, receiver.plan("/down", *[500] * 10))
    finished(tenant, job_id)
    receiver.wait_for("/down", MAX_ATTEMPTS)
    delivery_id = str(rds.hget(keys.job(job_id), "delivery_id"))
    state = wait_delivery(rds, delivery_id, "failed")
    assert state["attempts"] == str(MAX_ATTEMPTS), state
    assert f"gave up after {MAX_ATTEMPTS} attempts" in state["last_error"], state
    time.sleep(BACKOFF_CAP_S * 3 + SWEEP_S)
    assert len(receiver.received("/down")) == MAX_ATTEMPTS
    assert rds.zscore(keys.WEBHOOK_DUE, delivery_id) is None


def test_a_job_finished_twice_has_one_delivery_id_and_one_delivery(
    celery_worker: CeleryWorker, receiver: Receiver, tenant: Tenant, model: str, rds: redis.Redis,
    pending: Callable[[str, str], int],
) -> None:
    job_id = submit(tenant, model, receiver.plan("/once", 200, 200, 200))
    finished(tenant, job_id)
    receiver.wait_for("/once", 1)
    job_key = keys.job(job_id)
    delivery_id = str(rds.hget(job_key, "delivery_id"))
    wait_delivery(rds, delivery_id, "delivered")

    # The worker that stored the outcome died before acknowledging: its entry comes back to a
    # worker, which finds the job final and acknowledges it without running it again ...
    stream = keys.stream(model, "v1", "online")
    rds.xadd(stream, {"id": job_id, "tenant": tenant.id, "cost": "2", "t": repr(time.time())})
    wait_until(lambda: rds.xlen(stream) == 0 and pending(model, "v1") == 0, timeout_s=30,
               what="the redelivered entry acknowledged")
    # ... and a worker that ran it all the same stores nothing a second time.
    again = rds.eval(scripts.FINISH, *finish_one_call(rds, model, job_id, '{"echo":"again"}'))
    assert again == [0]
    # The relay died after publishing, before acknowledging: the same entry is relayed again.
    rds.xadd(keys.WEBHOOK_OUTBOX, {"delivery": delivery_id, "job": job_id})
    # (Celery keeps a task id's first successful result, so the worker's log is where it shows.)
    skipped = f"deliver_webhook[{delivery_id}] succeeded in"
    wait_until(lambda: any(skipped in line and "'skipped'" in line for line in celery_worker.log().splitlines()),
               timeout_s=30, what="the duplicate task skipping the delivered webhook")

    time.sleep(1.0)
    requests = receiver.received("/once")
    assert len(requests) == 1, [r.headers.get("sluice-delivery") for r in requests]
    assert rds.hget(job_key, "delivery_id") == delivery_id
    assert delivery_state(rds, delivery_id)["attempts"] == "1"
    assert rds.xlen(keys.WEBHOOK_OUTBOX) == 0


def _final_job_with_callback(rds: redis.Redis, tenant: Tenant, model: str, callback_url: str) -> tuple[str, str]:
    """A succeeded job written straight to Redis, finished by finish.lua; answer (job, delivery) ids."""
    now = time.time()
    record = JobRecord(id=new_job_id(model, "v1"), tenant=tenant.id, model=model, version="v1", lane="online",
                       status=JobStatus.running, input={"text": "x"}, enqueued_at=now, callback_url=callback_url)
    rds.hset(keys.job(record.id), mapping=record.to_redis())  # type: ignore[arg-type]
    assert rds.eval(scripts.FINISH, *finish_one_call(rds, model, record.id, '{"echo":"x"}')) == [1]
    return record.id, str(rds.hget(keys.job(record.id), "delivery_id"))


def test_an_address_refused_at_send_time_is_not_called(
    celery_worker: CeleryWorker, tenant: Tenant, model: str, rds: redis.Redis,
) -> None:
    """A callback that passed at submit time (or was stored by an older release) but leads to a
    private address when it is sent: the delivery fails without a request."""
    _, delivery_id = _final_job_with_callback(rds, tenant, model, "http://10.11.12.13:9/hook")
    state = wait_delivery(rds, delivery_id, "failed")
    assert state["attempts"] == "1" and "private address" in state["last_error"], state
    assert state["last_status"] == ""


def test_beat_resends_a_delivery_whose_retry_message_was_lost(
    celery_worker: CeleryWorker, receiver: Receiver, tenant: Tenant, model: str, rds: redis.Redis,
) -> None:
    url = receiver.plan("/lost", 200)
    job_id, delivery_id = _final_job_with_callback(rds, tenant, model, url)
    receiver.wait_for("/lost", 1)
    wait_delivery(rds, delivery_id, "delivered")
    # Now the same delivery as if its first attempt had failed and the retry message was lost.
    now = time.time()
    rds.hset(keys.delivery(delivery_id), mapping={"status": "retrying", "next_at": repr(now - 5)})
    rds.zadd(keys.WEBHOOK_DUE, {delivery_id: now - 5})
    requests = receiver.wait_for("/lost", 2, timeout_s=SWEEP_S * 10)
    assert requests[1].headers["sluice-delivery"] == delivery_id
    state = wait_delivery(rds, delivery_id, "delivered")
    assert state["attempts"] == "2" and state["job"] == job_id
    assert "re-sent" in celery_worker.log()


def test_the_celery_relay_takes_over_an_entry_left_by_a_dead_relay(
    celery_worker: CeleryWorker, receiver: Receiver, tenant: Tenant, model: str, rds: redis.Redis,
) -> None:
    url = receiver.plan("/orphan", 200)
    now = time.time()
    record = JobRecord(id=new_job_id(model, "v1"), tenant=tenant.id, model=model, version="v1", lane="online",
                       status=JobStatus.running, input={"text": "x"}, enqueued_at=now, callback_url=url)
    rds.hset(keys.job(record.id), mapping=record.to_redis())  # type: ignore[arg-type]
    outbox = keys.outbox(model, "v1")
    wait_until(lambda: _has_relay_group(rds, outbox), timeout_s=10, what="the live relay reading the version's outbox")
    # Finish it and, in the same transaction, let a relay that then dies read the outbox entry,
    # so the live relay never sees it as new.
    pipe = rds.pipeline(transaction=True)
    # EVAL by name: a cluster pipeline blocks its eval() method, not the command.
    pipe.execute_command("EVAL", scripts.FINISH, *finish_one_call(rds, model, record.id, '{"echo":"x"}'))
    pipe.xreadgroup(keys.RELAY_GROUP, "relay-dead", {outbox: ">"}, count=100)
    finished_ok, read = pipe.execute()
    assert finished_ok == [1] and read, read
    [request] = receiver.wait_for("/orphan", 1, timeout_s=CLAIM_AFTER_S * 10)
    assert request.headers["sluice-delivery"] == rds.hget(keys.job(record.id), "delivery_id")
    wait_until(lambda: _outbox_pending(rds, outbox) == 0, timeout_s=10, what="the outbox entry acknowledged")


def test_a_cancelled_job_gets_its_webhook(
    celery_worker: CeleryWorker, receiver: Receiver, tenant: Tenant, hooks_api: ApiServer,
    register_synthetic: Callable[..., str], rds: redis.Redis,
) -> None:
    idle = register_synthetic("idle")  # no worker: the job stays queued until it is cancelled
    hooks_api.reload_routing()
    job_id = submit(tenant, idle, receiver.plan("/cancelled", 200))
    response = tenant.client.delete(f"/v1/jobs/{job_id}")
    assert response.status_code == 200 and response.json()["status"] == "cancelled", response.text
    [request] = receiver.wait_for("/cancelled", 1)
    assert json.loads(request.body)["status"] == "cancelled"
    assert request.headers["sluice-delivery"] == rds.hget(keys.job(job_id), "delivery_id")
    assert verify(tenant.webhook_secret, request.headers["sluice-signature"], request.body)


@pytest.mark.parametrize(("how", "status"), [("deadline", "expired"), ("deliveries", "failed")])
def test_a_job_ended_by_the_claim_script_gets_its_webhook(
    celery_worker: CeleryWorker, receiver: Receiver, tenant: Tenant, model: str, rds: redis.Redis,
    how: str, status: str,
) -> None:
    """A worker claiming a job past its deadline, or delivered max_deliveries times already."""
    path = f"/claimed-{how}"
    now = time.time()
    record = JobRecord(id=new_job_id(model, "v1"), tenant=tenant.id, model=model, version="v1", lane="online",
                       status=JobStatus.queued, input={"text": "x"}, enqueued_at=now - 10,
                       callback_url=receiver.plan(path, 200), deadline=now - 1 if how == "deadline" else None,
                       attempts=3 if how == "deliveries" else 0)
    rds.hset(keys.job(record.id), mapping=record.to_redis())  # type: ignore[arg-type]
    verdict = claim_one(rds, model, record.id, tenant.id)
    assert verdict[0] == ("expired" if how == "deadline" else "dead"), verdict
    [request] = receiver.wait_for(path, 1)
    assert json.loads(request.body)["status"] == status
    assert request.headers["sluice-delivery"] == rds.hget(keys.job(record.id), "delivery_id")
