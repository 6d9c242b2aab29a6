"""`Deliverer` on its own (workers/delivery.py): real Redis and Postgres, a real HTTP receiver on
127.0.0.1, a clock the test moves, and no Celery app anywhere. tests/integration/test_webhooks.py
covers the same attempts run as Celery tasks."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime

import httpx
import pytest
import redis

from launch.seed import Seeded
from sluice.registry import tenants
from sluice.registry.store import Registry
from sluice.webhooks import allowed_networks, verify
from sluice.wire import keys
from sluice.wire.connections import connect_sync
from sluice.wire.jobs import JobRecord, JobStatus
from sluice.wire.keys import new_job_id
from sluice_client import verify as receiver_verify
from tests.support import REPO, Received, Receiver, receiving, unique
from workers.delivery import USER_AGENT, Deliverer, TenantLimits

MAX_ATTEMPTS = 3
# Longer than the slack a retry may run early (EARLY_SLACK_S), so an early attempt is refused.
BACKOFF_S = 10.0


@dataclass
class Clock:
    now: float

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock(time.time())


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with receiving() as state:
        yield state


@pytest.fixture
def deliverer(redis_url: str, database_url: str, seeded: Seeded, clock: Clock) -> Iterator[Deliverer]:
    made = Deliverer(
        redis=connect_sync(redis_url), registry=Registry(url=database_url, pool_size=1),
        http=httpx.Client(timeout=5.0, follow_redirects=False, trust_env=False),
        allowed=allowed_networks(["127.0.0.0/8"]), max_attempts=MAX_ATTEMPTS, backoff_base_s=BACKOFF_S,
        backoff_cap_s=BACKOFF_S, attempt_deadline_s=25.0,
        tenant_limits=TenantLimits(in_flight=8, rate_per_s=100.0, burst=100), ttl_s=600, clock=clock,
        rng=random.Random(7),
    )
    yield made
    made.close()


def final_job(rds: redis.Redis, callback_url: str, deliveries: list[str], *, tenant: str = "demo") -> tuple[str, str]:
    """A succeeded job of `tenant`, written straight to Redis; answer (job, delivery) ids."""
    now = time.time()
    record = JobRecord(id=new_job_id("direct", "v1"), tenant=tenant, model="direct", version="v1", lane="online",
                       status=JobStatus.succeeded, input={"text": "x"}, enqueued_at=now,
                       output={"echo": "x"}, callback_url=callback_url)
    rds.hset(keys.job(record.id), mapping=record.to_redis())  # type: ignore[arg-type]
    rds.expire(keys.job(record.id), 600)
    delivery_id = f"dlv_{new_job_id('direct', 'v1')}"
    deliveries.append(delivery_id)
    return record.id, delivery_id


def test_importing_delivery_does_not_import_celery() -> None:
    check = "import sys, workers.delivery; assert not {'celery', 'kombu'} & set(sys.modules), 'celery imported'"
    result = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_an_attempt_posts_the_signed_job_once(
    deliverer: Deliverer, receiver: Receiver, rds: redis.Redis, registry: Registry, deliveries: list[str],
) -> None:
    job_id, delivery_id = final_job(rds, receiver.plan("/direct", 200), deliveries)
    attempt = deliverer.attempt(delivery_id, job_id)
    assert (attempt.outcome, attempt.number, attempt.detail) == ("delivered", 1, "answered 200")
    [request] = receiver.received("/direct")
    with registry.session() as session:
        secret = tenants.tenant_secret(session, "demo")
    assert secret and verify(secret, request.headers["sluice-signature"], request.body, now=deliverer.clock())
    assert request.headers["sluice-delivery"] == delivery_id
    assert request.headers["webhook-id"] == delivery_id
    assert request.headers["webhook-timestamp"] == str(int(deliverer.clock()))
    assert receiver_verify(secret, request.headers, request.body, now=deliverer.clock())  # all three forms
    assert request.headers["user-agent"] == USER_AGENT
    state = rds.hgetall(keys.delivery(delivery_id))
    assert state["status"] == "delivered" and state["attempts"] == "1" and state["job"] == job_id  # type: ignore[index]

    again = deliverer.attempt(delivery_id, job_id)
    assert (again.outcome, again.detail) == ("skipped", "delivered")
    assert len(receiver.received("/direct")) == 1


def test_a_5xx_is_retried_only_when_due_and_the_sweep_finds_it_overdue(
    deliverer: Deliverer, receiver: Receiver, rds: redis.Redis, clock: Clock, deliveries: list[str],
) -> None:
    job_id, delivery_id = final_job(rds, receiver.plan("/retry", 503, 200), deliveries)
    first = deliverer.attempt(delivery_id, job_id)
    assert first.outcome == "retry" and first.number == 1
    assert BACKOFF_S / 2 <= first.retry_in_s <= BACKOFF_S
    assert rds.hget(keys.delivery(delivery_id), "status") == "retrying"

    early = deliverer.attempt(delivery_id, job_id)  # a duplicate message, long before its time
    assert (early.outcome, early.detail) == ("skipped", "early")
    assert (delivery_id, job_id) not in deliverer.overdue(grace_s=1.0)

    clock.now += first.retry_in_s + 2.0  # the retry message was lost: only the sweep finds it
    assert (delivery_id, job_id) in deliverer.overdue(grace_s=1.0)
    assert rds.zscore(keys.WEBHOOK_DUE, delivery_id) == pytest.approx(clock.now + 1.0)

    second = deliverer.attempt(delivery_id, job_id)
    assert (second.outcome, second.number) == ("delivered", 2)
    assert len(receiver.received("/retry")) == 2
    assert rds.zscore(keys.WEBHOOK_DUE, delivery_id) is None


def test_a_job_record_that_is_gone_fails_without_a_request(
    deliverer: Deliverer, receiver: Receiver, rds: redis.Redis, deliveries: list[str],
) -> None:
    job_id, delivery_id = final_job(rds, receiver.plan("/gone", 200), deliveries)
    rds.delete(keys.job(job_id))
    attempt = deliverer.attempt(delivery_id, job_id)
    assert attempt.outcome == "failed" and "no longer exists" in attempt.detail
    assert receiver.received("/gone") == []
    assert rds.hget(keys.delivery(delivery_id), "status") == "failed"


# --- secrets: rotation, and one tenant's never signing another's ------------------------------------


def signed_with(secret: str, request: Received, now: float) -> dict[str, bool]:
    """Which of the request's signatures `secret` verifies, each form alone."""
    headers = request.headers
    standard = {name: headers[name] for name in ("webhook-id", "webhook-timestamp", "webhook-signature")}
    return {"sluice": receiver_verify(secret, headers["sluice-signature"], request.body, now=now),
            "standard": receiver_verify(secret, standard, request.body, now=now)}


def _new_tenant(registry: Registry, prefix: str) -> tuple[str, str]:
    """A new tenant, and the webhook secret it was made with."""
    tenant = unique(prefix)
    with registry.session() as session:
        row, _ = tenants.create_tenant(session, tenant_id=tenant, actor="test")
        return tenant, row.webhook_secret


BOTH = {"sluice": True, "standard": True}
NEITHER = {"sluice": False, "standard": False}


def test_a_rotation_signs_with_both_secrets_until_its_overlap_ends(
    deliverer: Deliverer, receiver: Receiver, rds: redis.Redis, registry: Registry, clock: Clock,
    deliveries: list[str],
) -> None:
    tenant, old = _new_tenant(registry, "rotating")
    with registry.session() as session:
        row, entry = tenants.rotate_webhook_secret(session, tenant_id=tenant, actor="test", overlap_s=60,
                                                   now=datetime.fromtimestamp(clock.now, UTC))
        new = row.webhook_secret
        assert entry is not None and entry.action == "tenant.webhook_secret.rotate"
        assert old not in str(entry.after) and new not in str(entry.after)  # the audit row holds no secret
    assert new.startswith("whsec_") and new != old

    job_id, delivery_id = final_job(rds, receiver.plan("/rotating", 503, 200), deliveries, tenant=tenant)
    first = deliverer.attempt(delivery_id, job_id)
    assert first.outcome == "retry"
    clock.now += first.retry_in_s + 1.0
    assert deliverer.attempt(delivery_id, job_id).outcome == "delivered"
    requests = receiver.received("/rotating")
    assert len(requests) == 2
    for request in requests:
        assert request.headers["webhook-id"] == delivery_id  # the same on the retry: receivers dedupe on it
        assert request.headers["webhook-signature"].count("v1,") == 2
        now = float(request.headers["webhook-timestamp"])
        assert signed_with(new, request, now) == BOTH and signed_with(old, request, now) == BOTH

    clock.now += 61.0  # the overlap has ended, and the deliverer's cache of the secrets with it
    job_id, delivery_id = final_job(rds, receiver.plan("/rotated", 200), deliveries, tenant=tenant)
    assert deliverer.attempt(delivery_id, job_id).outcome == "delivered"
    [request] = receiver.received("/rotated")
    assert request.headers["webhook-signature"].count("v1,") == 1
    assert signed_with(new, request, clock.now) == BOTH and signed_with(old, request, clock.now) == NEITHER


def test_a_rotation_without_overlap_stops_the_old_secret_at_once(
    deliverer: Deliverer, receiver: Receiver, rds: redis.Redis, registry: Registry, clock: Clock,
    deliveries: list[str],
) -> None:
    tenant, old = _new_tenant(registry, "cut")
    given = "a-secret-chosen-by-the-operator-0123"
    with registry.session() as session:
        row, _ = tenants.rotate_webhook_secret(session, tenant_id=tenant, actor="test", secret=given, overlap_s=0)
        assert row.webhook_secret == given
        assert row.webhook_secret_previous is None and row.webhook_secret_previous_until is None
    job_id, delivery_id = final_job(rds, receiver.plan("/cut", 200), deliveries, tenant=tenant)
    assert deliverer.attempt(delivery_id, job_id).outcome == "delivered"
    [request] = receiver.received("/cut")
    assert signed_with(given, request, clock.now) == BOTH and signed_with(old, request, clock.now) == NEITHER


def test_one_tenants_secrets_never_sign_another_tenants_delivery(
    deliverer: Deliverer, receiver: Receiver, rds: redis.Redis, registry: Registry, clock: Clock,
    deliveries: list[str],
) -> None:
    tenant, theirs = _new_tenant(registry, "other")
    with registry.session() as session:
        row, _ = tenants.rotate_webhook_secret(session, tenant_id=tenant, actor="test", overlap_s=3600)
        theirs_now = row.webhook_secret
        demo = tenants.tenant_secret(session, "demo")
    assert demo
    job_id, delivery_id = final_job(rds, receiver.plan("/demo-only", 200), deliveries)
    assert deliverer.attempt(delivery_id, job_id).outcome == "delivered"
    [request] = receiver.received("/demo-only")
    assert signed_with(demo, request, clock.now) == BOTH
    assert request.headers["webhook-signature"].count("v1,") == 1
    assert signed_with(theirs, request, clock.now) == NEITHER and signed_with(theirs_now, request, clock.now) == NEITHER
