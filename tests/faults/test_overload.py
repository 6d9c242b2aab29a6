"""Admission control under overload (ARCHITECTURE, "Admission"): load shedding, rate limit, quota.

Load shedding is driven open-loop (a fixed arrival timetable: each request is sent at its
scheduled time whatever happened to the earlier ones) at about 10x what one worker can serve.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import redis
from sqlalchemy import update

from sluice.registry.store import Registry
from sluice.registry.tables import ModelVersion
from sluice.wire import keys
from sluice.wire.events import channel as events_channel
from tests.support import lane_jobs, spawn_worker

from ._support import wait_statuses

# One worker, batches of at most 2, each item 100 ms of model time: a batch costs about
# 2 ms + 2 x 100 ms = 0.2 s, so the version serves about 10 jobs/s and 10x is about 100 requests/s,
# which the in-process API and this load generator can sustain together on two cores.
PER_ITEM_S = 0.1
FIXED_S = 0.002
MAX_BATCH = 2
MAX_WAIT_MS = 20.0
COST = f"fixed_s={FIXED_S}&per_item_s={PER_ITEM_S}&per_token_s=0"
BATCH_S = FIXED_S + MAX_BATCH * PER_ITEM_S
CAPACITY_PER_S = MAX_BATCH / BATCH_S
BUDGET_MS = 500.0
OVERLOAD = 10.0
# Long enough for about 250 admitted jobs: with fewer than 100 a nearest-rank p99 is the maximum,
# so one scheduling stall of this shared 2-core VM would decide the test.
DURATION_S = 25.0
# Client connections: enough for the offered rate at the API's latency, and below the API's
# Redis pool (64), which a larger fan-in exhausts (see test_a_burst_of_concurrent_submissions...).
CONNECTIONS = 32
# An admitted job's predicted wait (backlog / measured service rate) is at most the budget. What
# that prediction cannot see, and so the slack allows for:
#  - 2 x max_wait: the batch the job joins may wait up to max_wait_ms to close by age, and so may
#    the one ahead of it (the backlog counts jobs, not the time partial batches spend filling);
#  - one batch time: work is done in whole batches, not at a steady rate per job, so a job can
#    start up to one batch later than backlog / rate says (e.g. behind a batch that had just
#    started when it arrived, or when the batch before it ran with fewer items than the maximum).
SLACK_MS = 2 * MAX_WAIT_MS + BATCH_S * 1000.0
BOUND_MS = BUDGET_MS + SLACK_MS


def _tenant(admin: httpx.Client, client_for: Callable[[str], httpx.Client], **limits: Any) -> tuple[str, httpx.Client]:
    tenant = f"adm-{secrets.token_hex(3)}"
    response = admin.post("/v1/tenants", json={"id": tenant, **limits})
    assert response.status_code == 201, response.text
    return tenant, client_for(response.json()["key"]["secret"])


def _retry_after(response: httpx.Response) -> int:
    value = response.headers.get("Retry-After")
    assert value is not None, (response.status_code, response.text, dict(response.headers))
    assert value.isdigit() and int(value) >= 1, value
    return int(value)


def _nearest_rank(values: list[float], q: float) -> float:
    """Exact percentile by the nearest-rank method (no interpolation)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass
class Sent:
    scheduled_s: float  # since the start of the timetable
    sent_s: float  # when it actually went out
    answered_s: float
    status: int
    retry_after: str | None
    job_id: str | None
    body: str


async def _open_loop(base_url: str, key: str, model: str, *, rate: float, duration_s: float) -> list[Sent]:
    """Send `rate` requests a second for `duration_s`, each at its scheduled time whatever
    happened to the ones before it (open loop: a slow answer does not delay the next request)."""
    count = int(rate * duration_s)
    results: list[Sent] = []
    limits = httpx.Limits(max_connections=CONNECTIONS, max_keepalive_connections=CONNECTIONS)
    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, limits=limits,
                                 timeout=60.0) as session:
        loop = asyncio.get_running_loop()
        start = loop.time() + 0.2

        async def one(i: int) -> None:
            scheduled = start + i / rate
            await asyncio.sleep(max(0.0, scheduled - loop.time()))
            sent = loop.time()
            try:
                response = await session.post(f"/v1/models/{model}/jobs", json={"input": {"text": f"load {i}"}})
            except httpx.HTTPError as exc:  # counted as a failure below, never lost
                results.append(Sent(scheduled - start, sent - start, loop.time() - start, 0, None, None, repr(exc)))
                return
            job_id = response.json().get("id") if response.status_code == 202 else None
            results.append(Sent(scheduled - start, sent - start, loop.time() - start, response.status_code,
                                response.headers.get("Retry-After"), job_id, response.text[:300]))

        await asyncio.gather(*(one(i) for i in range(count)))
    return results


@dataclass
class OverloadRun:
    sent: list[Sent]
    accepted: list[str]
    records: dict[str, dict[str, str]]
    queue_wait_ms: list[float]
    figures: dict[str, Any]


@pytest.fixture(scope="module")
def overload(
    api: Any, admin: httpx.Client, client_for: Callable[[str], httpx.Client], registry: Registry,
    register_synthetic: Callable[..., str], rds: redis.Redis, redis_url: str, database_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[OverloadRun]:
    """One 10-second open-loop run at 10x capacity, shared by the tests that judge it."""
    model = register_synthetic("overload", cost=COST, max_batch_size=MAX_BATCH, max_wait_ms=MAX_WAIT_MS)
    with registry.session() as session:
        session.execute(update(ModelVersion).where(ModelVersion.model == model, ModelVersion.version == "v1")
                        .values(latency_budget_ms=BUDGET_MS))
    rds.publish(events_channel(rds), json.dumps({"type": "routing", "model": model}))
    api.reload_routing()  # the event reloads it too; this makes sure before the load starts
    assert api.app.state.sluice.routing.current().model(model).versions["v1"].latency_budget_ms == BUDGET_MS
    # A tenant whose own rate limit and quota are far away: every 429 here is load shedding.
    _, client = _tenant(admin, client_for, rate_limit_per_s=100_000, max_queued=1_000_000)
    key = client.headers["Authorization"].removeprefix("Bearer ")

    home = tmp_path_factory.mktemp("overload")
    worker = spawn_worker(redis_url=redis_url, database_url=database_url, home=home, log_path=home / "worker.log",
                          model=model)
    try:
        # Warm: nothing is shed until a worker has measured its service rate (refusing on a guess
        # would turn a cold start into an outage), so let it finish a few batches and report.
        warm = [client.post(f"/v1/models/{model}/jobs", json={"input": {"text": f"warm {i}"}}) for i in range(6)]
        wait_statuses(rds, [r.json()["id"] for r in warm], timeout_s=30)
        deadline = time.monotonic() + 10
        while not any(float(rds.hget(k, "items_per_s") or 0) > 0
                      for k in rds.scan_iter(match=keys.heartbeat_pattern(model, "v1"))):
            assert time.monotonic() < deadline, "no heartbeat with a service rate"
            time.sleep(0.1)

        rate = OVERLOAD * CAPACITY_PER_S
        sent = asyncio.run(_open_loop(api.url, key, model, rate=rate, duration_s=DURATION_S))
        accepted = [s.job_id for s in sent if s.job_id]
        records = wait_statuses(rds, accepted, timeout_s=60)
        waits = []
        for job_id in accepted:
            response = client.get(f"/v1/jobs/{job_id}")
            assert response.status_code == 200, response.text
            waits.append(float(response.json()["timings"]["queue_wait_ms"]))
    finally:
        worker.terminate()

    statuses: dict[int, int] = {}
    for s in sent:
        statuses[s.status] = statuses.get(s.status, 0) + 1
    span = max(s.sent_s for s in sent) - min(s.sent_s for s in sent)
    figures = {
        "capacity_per_s": round(CAPACITY_PER_S, 1),
        "offered_per_s": round(rate, 1),
        "achieved_per_s": round(len(sent) / span, 1) if span > 0 else None,
        "requests": len(sent),
        "statuses": statuses,
        "send_lag_p99_ms": round(_nearest_rank([s.sent_s - s.scheduled_s for s in sent], 0.99) * 1000, 1),
        "answer_p99_ms": round(_nearest_rank([s.answered_s - s.sent_s for s in sent], 0.99) * 1000, 1),
        "accepted": len(accepted),
        "queue_wait_ms": {"p50": round(_nearest_rank(waits, 0.5), 1), "p99": round(_nearest_rank(waits, 0.99), 1),
                          "max": round(max(waits), 1), "samples": len(waits), "method": "nearest-rank"},
        "bound_ms": {"budget": BUDGET_MS, "slack": SLACK_MS, "bound": BOUND_MS},
    }
    yield OverloadRun(sent=sent, accepted=accepted, records=records, queue_wait_ms=waits, figures=figures)


@pytest.mark.slow
@pytest.mark.soak  # a sustained overload, 30 s of it
def test_overload_sheds_with_retry_after_and_every_accepted_job_succeeds(
    overload: OverloadRun, figure: Callable[[str, object], None],
) -> None:
    for name, value in overload.figures.items():
        figure(name, value)
    sent = overload.sent
    statuses = overload.figures["statuses"]
    failures = [s for s in sent if s.status >= 500 or s.status == 0]
    assert not failures, f"{len(failures)} 5xx or transport errors, e.g. {failures[:3]}"
    assert set(statuses) <= {202, 429}, statuses
    # It really was overload: the load reached the API at several times capacity, and was shed.
    assert overload.figures["achieved_per_s"] >= 5 * CAPACITY_PER_S, overload.figures
    shed = [s for s in sent if s.status == 429]
    assert len(shed) > len(sent) / 2, statuses
    for s in shed:
        assert s.retry_after is not None and s.retry_after.isdigit() and int(s.retry_after) >= 1, s
        assert json.loads(s.body)["error"]["code"] == "too_many_requests", s
        assert "overloaded" in s.body, s
    finals = {r.get("status") for r in overload.records.values()}
    assert finals == {"succeeded"}, finals
    # Shedding is not refusing everything: about capacity x duration got through.
    assert len(overload.accepted) >= 0.5 * CAPACITY_PER_S * DURATION_S, overload.figures


@pytest.mark.slow
@pytest.mark.soak
def test_overload_p99_queue_wait_of_admitted_online_jobs_stays_within_budget(overload: OverloadRun) -> None:
    p99 = _nearest_rank(overload.queue_wait_ms, 0.99)
    assert p99 <= BOUND_MS, (
        f"p99 queue wait {p99:.0f} ms over budget {BUDGET_MS:g} + slack {SLACK_MS:g} ms: {overload.figures}")


@pytest.mark.slow
def test_a_burst_of_concurrent_submissions_gets_no_5xx(
    api: Any, seeded: Any, register_synthetic: Callable[..., str], admin: httpx.Client,
    client_for: Callable[[str], httpx.Client], figure: Callable[[str, object], None],
) -> None:
    model = register_synthetic("burst")  # no worker and no service rate: nothing is shed
    _, client = _tenant(admin, client_for, rate_limit_per_s=100_000, max_queued=1_000_000)
    key = client.headers["Authorization"].removeprefix("Bearer ")

    async def burst(n: int) -> list[int]:
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        async with httpx.AsyncClient(base_url=api.url, headers={"Authorization": f"Bearer {key}"}, limits=limits,
                                     timeout=60.0) as session:
            responses = await asyncio.gather(*(session.post(f"/v1/models/{model}/jobs",
                                                            json={"input": {"text": f"burst {i}"}})
                                               for i in range(n)))
        return [r.status_code for r in responses]

    codes = asyncio.run(burst(200))
    summary = {c: codes.count(c) for c in set(codes)}
    figure("burst_statuses", summary)
    assert set(codes) == {202}, summary


def test_tenant_rate_limit_answers_429_with_retry_after(
    admin: httpx.Client, client_for: Callable[[str], httpx.Client], register_synthetic: Callable[..., str],
    figure: Callable[[str, object], None],
) -> None:
    model = register_synthetic("ratelimit")
    # 5 jobs/s; the bucket holds 10 s of it (burst 50).
    _, client = _tenant(admin, client_for, rate_limit_per_s=5)
    started = time.monotonic()
    responses = [client.post(f"/v1/models/{model}/jobs", json={"input": {"text": f"r {i}"}}) for i in range(60)]
    elapsed = time.monotonic() - started
    codes = [r.status_code for r in responses]
    figure("burst_statuses", {c: codes.count(c) for c in set(codes)})
    assert set(codes) == {202, 429}, codes
    first_refusal = codes.index(429)
    # The burst, plus what refilled while it was being sent.
    assert 50 <= first_refusal <= 50 + math.ceil(elapsed * 5), (elapsed, codes)
    refusals = [r for r in responses if r.status_code == 429]
    for response in refusals:
        assert response.json()["error"]["code"] == "too_many_requests", response.text
        assert "rate limit" in response.json()["error"]["message"], response.text
        _retry_after(response)
    wait_s = _retry_after(refusals[-1])
    # A bulk larger than what is left is refused whole, not half-queued.
    assert client.post(f"/v1/models/{model}/jobs:bulk", json={"inputs": [{"text": "b"}] * 20}).status_code == 429
    time.sleep(wait_s)
    response = client.post(f"/v1/models/{model}/jobs", json={"input": {"text": "after waiting"}})
    assert response.status_code == 202, response.text


def test_tenant_quota_on_queued_jobs_answers_429_with_retry_after(
    admin: httpx.Client, client_for: Callable[[str], httpx.Client], register_synthetic: Callable[..., str],
    rds: redis.Redis,
) -> None:
    model = register_synthetic("quota")  # no worker: what is accepted stays queued
    tenant, client = _tenant(admin, client_for, max_queued=3)
    ids = []
    for i in range(3):
        response = client.post(f"/v1/models/{model}/jobs", json={"input": {"text": f"q {i}"}})
        assert response.status_code == 202, response.text
        ids.append(response.json()["id"])
    assert rds.zcard(keys.queued_jobs(tenant)) == 3

    refused = client.post(f"/v1/models/{model}/jobs", json={"input": {"text": "one too many"}})
    assert refused.status_code == 429, refused.text
    assert "quota" in refused.json()["error"]["message"], refused.text
    _retry_after(refused)
    # Bulk and the bulk lane count against the same quota.
    refused = client.post(f"/v1/models/{model}/jobs:bulk", json={"inputs": [{"text": "a"}], "lane": "bulk"})
    assert refused.status_code == 429, refused.text
    _retry_after(refused)
    # The refused requests queued nothing.
    assert lane_jobs(rds, model, "v1", "online") == 3
    assert lane_jobs(rds, model, "v1", "bulk") == 0

    # Cancelling one frees its place.
    assert client.delete(f"/v1/jobs/{ids[0]}").status_code == 200
    response = client.post(f"/v1/models/{model}/jobs", json={"input": {"text": "room again"}})
    assert response.status_code == 202, response.text
    assert client.post(f"/v1/models/{model}/jobs", json={"input": {"text": "full again"}}).status_code == 429
