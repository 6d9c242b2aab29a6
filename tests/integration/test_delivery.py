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
from tests.support import REPO, Receiver, receiving
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


def final_job(rds: redis.Redis, callback_url: str, deliveries: list[str]) -> tuple[str, str]:
    """A succeeded job of the demo tenant, written straight to Redis; answer (job, delivery) ids."""
    now = time.time()
    record = JobRecord(id=new_job_id("direct", "v1"), tenant="demo", model="direct", version="v1", lane="online",
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
