"""One slow receiver stalls no other: a real socket server that sends its answer one byte every
second (a status line, then header lines without end) never trips a per-read timeout, so only
a deadline on the whole attempt ends it; a tenant's attempts in flight are a share of the pool and
its attempts pass a rate of its own, deferred (not lost, not counted) when over either.

The first tests drive `Deliverer.from_settings` against real Redis and Postgres; the last runs the
issue's scenario from outside: tenants submit and cancel jobs over REST (cancelling queues the
webhook), and a real Celery worker process delivers them.
"""

from __future__ import annotations

import itertools
import secrets
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from launch.seed import Seeded
from sluice.settings import Settings
from sluice.wire import keys
from sluice.wire.jobs import JobRecord, JobStatus
from sluice.wire.keys import new_job_id
from tests.support import (
    ApiServer,
    CeleryWorker,
    Receiver,
    celery_worker_env,
    celery_worker_process,
    receiving,
    serving,
    wait_until,
)
from workers.delivery import Attempt, Deliverer

pytestmark = pytest.mark.slow

DRIP_EVERY_S = 1.0
TIMEOUT_S = 3.0  # per network operation: longer than the drip's pause, so it never trips
DEADLINE_S = 2.0  # the whole attempt
SLACK_S = 1.5


# --- the slow-drip receiver --------------------------------------------------------------------------


@dataclass
class Drip:
    """A receiver that reads the request, then sends `HTTP/1.1 200 OK\\r\\n` and endless header
    lines, one byte every DRIP_EVERY_S, until the client closes the connection."""

    url: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)
    # (opened, closed by the client or None) per connection.
    connections: list[list[float | None]] = field(default_factory=list)
    open_now: int = 0
    most_open: int = 0

    def durations(self) -> list[float | None]:
        with self.lock:
            return [None if closed is None else closed - opened  # type: ignore[operator]
                    for opened, closed in self.connections]


def _read_request(conn: socket.socket) -> None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            return
        body += chunk


@contextmanager
def dripping() -> Iterator[Drip]:
    state = Drip()
    stop = threading.Event()
    listener = socket.create_server(("127.0.0.1", 0))
    state.url = f"http://127.0.0.1:{listener.getsockname()[1]}"

    def serve(conn: socket.socket) -> None:
        with state.lock:
            record: list[float | None] = [time.monotonic(), None]
            state.connections.append(record)
            state.open_now += 1
            state.most_open = max(state.most_open, state.open_now)
        try:
            _read_request(conn)
            for byte in itertools.chain(b"HTTP/1.1 200 OK\r\n", itertools.cycle(b"X-Drip: 1\r\n")):
                if stop.is_set():
                    return
                conn.sendall(bytes([byte]))
                readable, _, _ = select.select([conn], [], [], DRIP_EVERY_S)
                if readable and not conn.recv(1):
                    record[1] = time.monotonic()  # the client hung up
                    return
        except OSError:
            record[1] = time.monotonic()
        finally:
            with state.lock:
                state.open_now -= 1
            conn.close()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, name="drip-receiver", daemon=True)
    thread.start()
    try:
        yield state
    finally:
        stop.set()
        listener.close()
        thread.join(timeout=5)


@pytest.fixture
def drip() -> Iterator[Drip]:
    with dripping() as state:
        yield state


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with receiving() as state:
        yield state


# --- Deliverer on its own ----------------------------------------------------------------------------


@pytest.fixture
def deliverer_for(settings: Settings, seeded: Seeded) -> Iterator[Callable[..., Deliverer]]:
    made: list[Deliverer] = []

    def make(**overrides: Any) -> Deliverer:
        made.append(Deliverer.from_settings(settings.model_copy(update={
            "webhook_allowed_networks": ["127.0.0.0/8"], "webhook_timeout_s": TIMEOUT_S,
            "webhook_attempt_deadline_s": DEADLINE_S, "webhook_max_attempts": 3, **overrides})))
        return made[-1]

    yield make
    for deliverer in made:
        deliverer.close()


def final_job(rds: redis.Redis, tenant: str, callback_url: str, deliveries: list[str]) -> tuple[str, str]:
    """A succeeded job of `tenant`, written straight to Redis; answer (delivery, job) ids."""
    record = JobRecord(id=new_job_id("direct", "v1"), tenant=tenant, model="direct", version="v1", lane="online",
                       status=JobStatus.succeeded, input={"text": "x"}, enqueued_at=time.time(),
                       output={"echo": "x"}, callback_url=callback_url)
    rds.hset(keys.job(record.id), mapping=record.to_redis())  # type: ignore[arg-type]
    rds.expire(keys.job(record.id), 600)
    delivery_id = f"dlv_{secrets.token_hex(16)}"
    deliveries.append(delivery_id)
    return delivery_id, record.id


def in_thread(deliverer: Deliverer, delivery_id: str, job_id: str) -> tuple[threading.Thread, list[Attempt]]:
    done: list[Attempt] = []
    thread = threading.Thread(target=lambda: done.append(deliverer.attempt(delivery_id, job_id)), daemon=True)
    thread.start()
    return thread, done


def test_a_receiver_that_drips_its_answer_is_cut_off_at_the_attempt_deadline(
    deliverer_for: Callable[..., Deliverer], drip: Drip, rds: redis.Redis, deliveries: list[str],
    new_tenant: Callable[..., tuple[str, httpx.Client]],
) -> None:
    tenant, _ = new_tenant("drip")
    deliverer = deliverer_for()
    delivery_id, job_id = final_job(rds, tenant, f"{drip.url}/hook", deliveries)
    started = time.monotonic()
    thread, done = in_thread(deliverer, delivery_id, job_id)
    thread.join(timeout=DEADLINE_S + SLACK_S)
    assert not thread.is_alive(), f"the attempt still runs {time.monotonic() - started:.1f}s after it started"
    [attempt] = done
    assert (attempt.outcome, attempt.number) == ("retry", 1), attempt
    assert "ReadTimeout" in attempt.detail and "deadline" in attempt.detail, attempt
    state = rds.hgetall(keys.delivery(delivery_id))
    assert state["status"] == "retrying" and state["attempts"] == "1", state  # type: ignore[index]
    wait_until(lambda: [held is not None for held in drip.durations()] == [True], timeout_s=DRIP_EVERY_S * 3,
               what="the receiver seeing the connection closed")
    [held] = drip.durations()
    assert held is not None and held <= DEADLINE_S + SLACK_S, held


def test_a_tenant_over_its_share_is_deferred_uncounted_while_another_tenant_is_delivered(
    deliverer_for: Callable[..., Deliverer], drip: Drip, receiver: Receiver, rds: redis.Redis,
    deliveries: list[str], new_tenant: Callable[..., tuple[str, httpx.Client]],
) -> None:
    slow, _ = new_tenant("slow")
    other, _ = new_tenant("other")
    # One attempt in flight per tenant (an eighth of eight threads); the deadline out of the way.
    deliverer = deliverer_for(webhook_concurrency=8, webhook_tenant_share=0.125, webhook_attempt_deadline_s=20.0,
                              webhook_timeout_s=20.0)
    held_id, held_job = final_job(rds, slow, f"{drip.url}/held", deliveries)
    holding, _ = in_thread(deliverer, held_id, held_job)
    wait_until(lambda: len(drip.connections) == 1, timeout_s=5, what="the first attempt reaching the receiver")

    waiting_id, waiting_job = final_job(rds, slow, f"{drip.url}/second", deliveries)
    second, done = in_thread(deliverer, waiting_id, waiting_job)
    second.join(timeout=SLACK_S)
    assert not second.is_alive(), "the tenant's second attempt waits on its first instead of being deferred"
    [deferred] = done
    assert deferred.outcome == "deferred" and 0 < deferred.retry_in_s <= 20.0, deferred
    state = rds.hgetall(keys.delivery(waiting_id))
    assert state["status"] == "deferred" and "attempts" not in state, state  # type: ignore[operator,index]
    # Not lost: due again when it was told, where the sweep finds it should its message be lost.
    due = rds.zscore(keys.WEBHOOK_DUE, waiting_id)
    assert due is not None and due == pytest.approx(time.time() + deferred.retry_in_s, abs=SLACK_S)
    assert len(drip.connections) == 1

    other_id, other_job = final_job(rds, other, receiver.plan("/other", 200), deliveries)
    assert deliverer.attempt(other_id, other_job).outcome == "delivered"
    assert len(receiver.received("/other")) == 1
    assert holding.is_alive()  # the slow tenant's attempt still holds its one place


def test_a_tenant_over_its_rate_is_deferred_a_turn_each_and_delivered_later(
    deliverer_for: Callable[..., Deliverer], receiver: Receiver, rds: redis.Redis, deliveries: list[str],
    new_tenant: Callable[..., tuple[str, httpx.Client]],
) -> None:
    noisy, _ = new_tenant("noisy")
    quiet, _ = new_tenant("quiet")
    deliverer = deliverer_for(webhook_rate_per_tenant_s=0.25, webhook_rate_burst=2)
    now = time.time()
    deliverer.clock = lambda: now
    made = [final_job(rds, noisy, receiver.plan(f"/noisy-{n}", 200), deliveries) for n in range(4)]
    outcomes = [deliverer.attempt(delivery_id, job_id) for delivery_id, job_id in made]
    assert [a.outcome for a in outcomes] == ["delivered", "delivered", "deferred", "deferred"], outcomes
    # Each deferred attempt holds a turn of its own, one interval (4 s) apart: no herd comes back at once.
    assert [a.retry_in_s for a in outcomes[2:]] == [pytest.approx(4.0, abs=0.01), pytest.approx(8.0, abs=0.01)]
    assert all("attempts" not in rds.hgetall(keys.delivery(d)) for d, _ in made[2:])  # type: ignore[operator]
    quiet_id, quiet_job = final_job(rds, quiet, receiver.plan("/quiet", 200), deliveries)
    assert deliverer.attempt(quiet_id, quiet_job).outcome == "delivered"  # a rate of its own

    now += 4.0
    third = deliverer.attempt(*made[2])
    fourth = deliverer.attempt(*made[3])
    assert (third.outcome, third.number) == ("delivered", 1), third
    assert (fourth.outcome, fourth.detail) == ("skipped", "early"), fourth
    now += 4.0
    assert deliverer.attempt(*made[3]).outcome == "delivered"
    assert [len(receiver.received(f"/noisy-{n}")) for n in range(4)] == [1, 1, 1, 1]


# --- the scenario, from outside ---------------------------------------------------------------


@pytest.fixture(scope="module")
def hooks_api(settings: Settings, seeded: Seeded) -> Iterator[ApiServer]:
    """An API replica that lets callbacks reach 127.0.0.0/8."""
    with serving(settings.model_copy(update={"webhook_allowed_networks": ["127.0.0.0/8"]})) as server:
        yield server


@pytest.fixture
def celery_worker(redis_url: str, database_url: str, home: Path, seeded: Seeded,
                  tmp_path: Path) -> Iterator[CeleryWorker]:
    """`celery -A workers.tasks worker` on every queue, with four threads, two of them a tenant's share."""
    env = celery_worker_env(
        redis_url=redis_url, database_url=database_url, home=home,
        SLUICE_WEBHOOK_TIMEOUT_S=str(TIMEOUT_S), SLUICE_WEBHOOK_ATTEMPT_DEADLINE_S=str(DEADLINE_S),
        SLUICE_WEBHOOK_CONCURRENCY="4", SLUICE_WEBHOOK_TENANT_SHARE="0.5", SLUICE_WEBHOOK_BACKOFF_BASE_S="0.5",
        SLUICE_WEBHOOK_BACKOFF_CAP_S="1", SLUICE_WEBHOOK_SWEEP_S="1",
    )
    with celery_worker_process(env, log_path=tmp_path / "celery.log", name="slow") as worker:
        yield worker


def _cancelled_with_callback(client: httpx.Client, model: str, callback_url: str) -> str:
    submitted = client.post(f"/v1/models/{model}/jobs", json={"input": {"text": "a"}, "callback_url": callback_url})
    assert submitted.status_code == 202, submitted.text
    job_id: str = submitted.json()["id"]
    cancelled = client.delete(f"/v1/jobs/{job_id}")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled", cancelled.text
    return job_id


def test_ten_dripping_webhooks_of_one_tenant_do_not_hold_up_another_tenants(
    hooks_api: ApiServer, celery_worker: CeleryWorker, drip: Drip, receiver: Receiver, rds: redis.Redis,
    admin: httpx.Client, register_synthetic: Callable[..., str],
) -> None:
    idle = register_synthetic("slowhooks")  # no worker: a job stays queued until it is cancelled
    hooks_api.reload_routing()
    clients = []
    for prefix in ("dripper", "bystander"):
        made = admin.post("/v1/tenants", json={"id": f"{prefix}-{secrets.token_hex(3)}"})
        assert made.status_code == 201, made.text
        clients.append(httpx.Client(base_url=hooks_api.url, timeout=30,
                                    headers={"Authorization": f"Bearer {made.json()['key']['secret']}"}))
    dripper, bystander = clients
    job_ids: list[str] = []
    try:
        job_ids += [_cancelled_with_callback(dripper, idle, f"{drip.url}/slow") for _ in range(10)]
        wait_until(lambda: len(drip.connections) >= 2, timeout_s=30, what="the dripping receiver called")
        sent_at = time.monotonic()
        job_ids.append(_cancelled_with_callback(bystander, idle, receiver.plan("/prompt", 200)))
        receiver.wait_for("/prompt", 1, timeout_s=15)
        assert time.monotonic() - sent_at < 15
        time.sleep(DEADLINE_S * 2)

        # The dripping tenant held at most its share of the four threads at once, each for at most
        # an attempt's deadline, and none of its deliveries is lost: each waits for its next turn.
        assert drip.most_open <= 2, drip.most_open
        assert all(held is None or held <= DEADLINE_S + SLACK_S for held in drip.durations()), drip.durations()
        assert sum(held is None for held in drip.durations()) <= 2, drip.durations()  # only those open now
        states = [rds.hgetall(keys.delivery(str(rds.hget(keys.job(job_id), "delivery_id"))))
                  for job_id in job_ids[:10]]
        assert all(state.get("status") in {"sending", "retrying", "deferred"} for state in states), states  # type: ignore[union-attr]
    finally:
        for client in clients:
            client.close()
        for job_id in job_ids:
            delivery_id = rds.hget(keys.job(job_id), "delivery_id")
            if delivery_id:
                rds.zrem(keys.WEBHOOK_DUE, str(delivery_id))
                rds.delete(keys.delivery(str(delivery_id)))
