"""Admission across API replicas (ARCHITECTURE, "Admission").

Two `sluice api` processes on their own ports, one Redis and one Postgres, and the overload of
test_overload.py (open loop at about 10x what one synthetic worker serves) split across them,
request by request. Load shedding reads the version's backlog from Redis, but each replica caches
that read briefly and adds only its own admissions on top; the tenant's rate limit is charged in
the enqueue script. Both must hold for the pair as they do for one replica: the pair admits no
more than one replica does under the same offered load (measured here, on the same model, rate
and duration, not remembered), its admitted jobs wait no longer than the overload test allows,
and a concurrent burst split across both takes exactly the tenant's burst.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from sqlalchemy import update

from sluice.registry.store import Registry
from sluice.registry.tables import ModelVersion, Tenant
from sluice.wire import keys
from tests.support import REPO, lane_jobs, spawn_worker, stop_process, wait_until

from ._support import free_port, wait_statuses
from .test_overload import (
    BOUND_MS,
    BUDGET_MS,
    CAPACITY_PER_S,
    CONNECTIONS,
    COST,
    DURATION_S,
    MAX_BATCH,
    MAX_WAIT_MS,
    OVERLOAD,
    SLACK_MS,
    _nearest_rank,
    _retry_after,
    _tenant,
)

# Two extra API processes and two 25 s overload runs: over a minute of a loaded machine.
pytestmark = [pytest.mark.slow, pytest.mark.soak]

# What the pair may admit over one replica. Admitted jobs are what the worker served during the
# run plus what was still queued at its end (shedding keeps that queue near budget x rate = 5
# jobs), about 250 + 5 either way: the count moves with the worker's pace on a shared 2-core VM
# (a few per cent between runs), not with the number of replicas, unless replicas let the queue
# grow past the budget. 25 % is well clear of that noise, and a pair whose caches let each fill
# the queue on its own would still show up in the queue wait bound below, which is the tighter
# of the two checks.
TOLERANCE = 0.25
RATE_BURST = 50
BURST_REQUESTS = 120


@dataclass
class Replica:
    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self, tail: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-tail:]


def _start_replica(name: str, *, redis_url: str, database_url: str, home: Path) -> Replica:
    """`sluice api` in a process of its own (its own interpreter, event loop, connections and
    admission state), on a free port of 127.0.0.1."""
    port = free_port()
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    environment.update({"SLUICE_REDIS_URL": redis_url, "SLUICE_DATABASE_URL": database_url, "SLUICE_HOME": str(home),
                        "SLUICE_SHUTDOWN_GRACE_S": "5", "PYTHONUNBUFFERED": "1"})
    log_path = home / f"{name}.log"
    with log_path.open("ab") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "launch.cli", "api", "--host", "127.0.0.1", "--port", str(port)],
                                cwd=REPO, env=environment, stdout=sink, stderr=subprocess.STDOUT)
    replica = Replica(name=name, url=f"http://127.0.0.1:{port}", proc=proc, log_path=log_path)

    def ready() -> bool:
        assert proc.poll() is None, f"{name} exited with {proc.returncode}:\n{replica.log()}"
        try:
            return httpx.get(f"{replica.url}/readyz", timeout=2).json().get("status") == "ok"
        except httpx.HTTPError:
            return False

    try:
        wait_until(ready, timeout_s=60, what=f"API replica {name}", interval_s=0.1)
    except BaseException:
        stop_process(proc, 15, 10)
        raise
    return replica


@pytest.fixture(scope="module")
def replicas(redis_url: str, database_url: str, tmp_path_factory: pytest.TempPathFactory,
             setup: dict[str, str]) -> Iterator[tuple[Replica, Replica]]:
    home = tmp_path_factory.mktemp("replicas")
    started: list[Replica] = []
    try:
        for name in ("replica-a", "replica-b"):
            started.append(_start_replica(name, redis_url=redis_url, database_url=database_url, home=home))
        yield started[0], started[1]
    finally:
        for replica in started:
            stop_process(replica.proc, 15, 20)


@pytest.fixture(scope="module")
def setup(admin: httpx.Client, client_for: Callable[[str], httpx.Client], registry: Registry,
          register_synthetic: Callable[..., str]) -> dict[str, str]:
    """The models and tenants, in the registry before the replicas start (so their first routing
    snapshot and key lookups already have them)."""
    overload = register_synthetic("replicas", cost=COST, max_batch_size=MAX_BATCH, max_wait_ms=MAX_WAIT_MS)
    ratelimit = register_synthetic("replrate")  # no worker and no service rate: nothing is shed
    with registry.session() as session:
        session.execute(update(ModelVersion).where(ModelVersion.model == overload, ModelVersion.version == "v1")
                        .values(latency_budget_ms=BUDGET_MS))
    # Every 429 on the overload model is shedding: its tenant's limits are far away.
    _, loaded = _tenant(admin, client_for, rate_limit_per_s=100_000, max_queued=1_000_000)
    # A burst of 50 that refills one token in 20 s: a burst answered within seconds gets 50 exactly.
    limited_tenant, limited = _tenant(admin, client_for, rate_limit_per_s=5, max_queued=1_000_000)
    with registry.session() as session:
        session.execute(update(Tenant).where(Tenant.id == limited_tenant)
                        .values(rate_limit_per_s=1 / 20, rate_burst=RATE_BURST))
    return {"overload": overload, "ratelimit": ratelimit,
            "loaded_key": loaded.headers["Authorization"].removeprefix("Bearer "),
            "limited_key": limited.headers["Authorization"].removeprefix("Bearer ")}


@dataclass
class Sent:
    replica: int
    scheduled_s: float
    sent_s: float
    status: int
    retry_after: str | None
    job_id: str | None
    body: str


async def _open_loop(urls: list[str], key: str, model: str, *, rate: float, duration_s: float) -> list[Sent]:
    """test_overload's open loop, request i going to urls[i % len(urls)]: the same timetable
    whatever the number of replicas, each replica getting an equal share of it."""
    count = int(rate * duration_s)
    results: list[Sent] = []
    limits = httpx.Limits(max_connections=CONNECTIONS, max_keepalive_connections=CONNECTIONS)
    sessions = [httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, limits=limits,
                                  timeout=60.0) for url in urls]
    try:
        loop = asyncio.get_running_loop()
        start = loop.time() + 0.2

        async def one(i: int) -> None:
            which = i % len(sessions)
            scheduled = start + i / rate
            await asyncio.sleep(max(0.0, scheduled - loop.time()))
            sent = loop.time()
            try:
                response = await sessions[which].post(f"/v1/models/{model}/jobs",
                                                      json={"input": {"text": f"load {i}"}})
            except httpx.HTTPError as exc:  # counted as a failure below, never lost
                results.append(Sent(which, scheduled - start, sent - start, 0, None, None, repr(exc)))
                return
            job_id = response.json().get("id") if response.status_code == 202 else None
            results.append(Sent(which, scheduled - start, sent - start, response.status_code,
                                response.headers.get("Retry-After"), job_id, response.text[:300]))

        await asyncio.gather(*(one(i) for i in range(count)))
    finally:
        for session in sessions:
            await session.aclose()
    return results


@dataclass
class Run:
    sent: list[Sent]
    accepted: list[str]
    queue_wait_ms: list[float]

    def summary(self) -> dict[str, Any]:
        statuses: dict[int, int] = {}
        for s in self.sent:
            statuses[s.status] = statuses.get(s.status, 0) + 1
        span = max(s.sent_s for s in self.sent) - min(s.sent_s for s in self.sent)
        per_replica = [sum(1 for s in self.sent if s.replica == r and s.job_id) for r in
                       sorted({s.replica for s in self.sent})]
        return {"requests": len(self.sent), "achieved_per_s": round(len(self.sent) / span, 1), "statuses": statuses,
                "admitted": len(self.accepted), "admitted_per_replica": per_replica,
                "send_lag_p99_ms": round(_nearest_rank([s.sent_s - s.scheduled_s for s in self.sent], 0.99) * 1000, 1),
                "queue_wait_ms": {"p50": round(_nearest_rank(self.queue_wait_ms, 0.5), 1),
                                  "p99": round(_nearest_rank(self.queue_wait_ms, 0.99), 1),
                                  "max": round(max(self.queue_wait_ms), 1), "samples": len(self.queue_wait_ms)}}


def _run(urls: list[str], key: str, model: str, rds: redis.Redis, client: httpx.Client) -> Run:
    sent = asyncio.run(_open_loop(urls, key, model, rate=OVERLOAD * CAPACITY_PER_S, duration_s=DURATION_S))
    accepted = [s.job_id for s in sent if s.job_id]
    records = wait_statuses(rds, accepted, timeout_s=90)
    finals = {r.get("status") for r in records.values()}
    assert finals <= {"succeeded"}, finals
    waits = []
    for job_id in accepted:
        response = client.get(f"/v1/jobs/{job_id}")
        assert response.status_code == 200, response.text
        waits.append(float(response.json()["timings"]["queue_wait_ms"]))
    failures = [s for s in sent if s.status not in (202, 429)]
    assert not failures, f"{len(failures)} answers other than 202 and 429, e.g. {failures[:3]}"
    for s in sent:
        if s.status == 429:
            assert s.retry_after is not None and s.retry_after.isdigit() and int(s.retry_after) >= 1, s
            assert "overloaded" in s.body, s
    return Run(sent=sent, accepted=accepted, queue_wait_ms=waits)


def test_two_replicas_under_overload_admit_no_more_than_one(
    replicas: tuple[Replica, Replica], setup: dict[str, str], client_for: Callable[[str], httpx.Client],
    rds: redis.Redis, redis_url: str, database_url: str, tmp_path: Path, figure: Callable[[str, object], None],
) -> None:
    a, b = replicas
    model, key = setup["overload"], setup["loaded_key"]
    client = client_for(key)
    worker = spawn_worker(redis_url=redis_url, database_url=database_url, home=tmp_path,
                          log_path=tmp_path / "worker.log", model=model)
    try:
        # Warm, through both replicas: nothing is shed until the worker has measured its rate.
        warm = [httpx.post(f"{r.url}/v1/models/{model}/jobs", json={"input": {"text": f"warm {i}"}},
                           headers={"Authorization": f"Bearer {key}"}, timeout=30)
                for i in range(6) for r in (a, b)]
        assert all(r.status_code == 202 for r in warm), [r.text for r in warm]
        wait_statuses(rds, [r.json()["id"] for r in warm], timeout_s=30)
        deadline = time.monotonic() + 10
        while not any(float(rds.hget(k, "items_per_s") or 0) > 0  # type: ignore[arg-type]
                      for k in rds.scan_iter(match=keys.heartbeat_pattern(model, "v1"))):
            assert time.monotonic() < deadline, "no heartbeat with a service rate"
            time.sleep(0.1)

        # The baseline first: one replica, the whole timetable; then the same timetable split.
        one = _run([a.url], key, model, rds, client)
        two = _run([a.url, b.url], key, model, rds, client)
    finally:
        worker.terminate()
        for replica in replicas:
            assert replica.proc.poll() is None, f"{replica.name} exited:\n{replica.log()}"

    figure("capacity_per_s", round(CAPACITY_PER_S, 1))
    figure("offered_per_s", round(OVERLOAD * CAPACITY_PER_S, 1))
    figure("duration_s", DURATION_S)
    figure("one_replica", one.summary())
    figure("two_replicas", two.summary())
    figure("admitted_ratio", round(len(two.accepted) / len(one.accepted), 3))
    figure("bound_ms", {"budget": BUDGET_MS, "slack": SLACK_MS, "bound": BOUND_MS})

    # It was overload both times, and both replicas took their share of it.
    for run in (one, two):
        assert run.summary()["achieved_per_s"] >= 5 * CAPACITY_PER_S, run.summary()
        assert sum(1 for s in run.sent if s.status == 429) > len(run.sent) / 2, run.summary()
        assert len(run.accepted) >= 0.5 * CAPACITY_PER_S * DURATION_S, run.summary()
    assert all(n > 0 for n in two.summary()["admitted_per_replica"]), two.summary()
    assert len(two.accepted) <= len(one.accepted) * (1 + TOLERANCE), (one.summary(), two.summary())
    p99 = _nearest_rank(two.queue_wait_ms, 0.99)
    assert p99 <= BOUND_MS, f"p99 queue wait {p99:.0f} ms over {BOUND_MS:g} ms with two replicas: {two.summary()}"
    # And no longer than one replica's, give or take one job's service time (a job the other
    # replica had admitted but not yet written when a fresh read was taken). On cached reads
    # alone each replica filled the room both saw: p99 289 -> 471 ms, p50 108 -> 212 ms, within
    # BOUND_MS yet about one batch more queue; the margin here is half that.
    one_p99 = _nearest_rank(one.queue_wait_ms, 0.99)
    assert p99 <= one_p99 + 1000.0 / CAPACITY_PER_S, (one.summary(), two.summary())


def test_tenant_rate_limit_holds_across_replicas(
    replicas: tuple[Replica, Replica], setup: dict[str, str], rds: redis.Redis, figure: Callable[[str, object], None],
) -> None:
    model, key = setup["ratelimit"], setup["limited_key"]
    urls = [r.url for r in replicas]

    async def burst() -> tuple[list[httpx.Response], float]:
        limits = httpx.Limits(max_connections=BURST_REQUESTS, max_keepalive_connections=BURST_REQUESTS)
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}, limits=limits,
                                     timeout=60.0) as session:
            started = time.monotonic()
            responses = await asyncio.gather(*(session.post(f"{urls[i % 2]}/v1/models/{model}/jobs",
                                                            json={"input": {"text": f"burst {i}"}})
                                               for i in range(BURST_REQUESTS)))
            return list(responses), time.monotonic() - started

    responses, elapsed = asyncio.run(burst())
    admitted = [[r for i, r in enumerate(responses) if i % 2 == which and r.status_code == 202] for which in (0, 1)]
    codes = [r.status_code for r in responses]
    figure("burst", {"requests": BURST_REQUESTS, "limit": RATE_BURST, "elapsed_s": round(elapsed, 2),
                     "statuses": {c: codes.count(c) for c in set(codes)},
                     "admitted_per_replica": [len(each) for each in admitted]})
    assert set(codes) <= {202, 429}, [r.text for r in responses if r.status_code not in (202, 429)][:3]
    # The bucket refills one token in 20 s, so nothing refilled while the burst was answered.
    assert elapsed < 20, elapsed
    # Each replica answered half the burst. Were the bucket per replica, each would admit up to 50
    # of its 60; shared, the pair admits 50 in all, however the race splits them between the two
    # (often unevenly: whichever replica's connections open first can take them all).
    assert codes.count(202) == RATE_BURST, {c: codes.count(c) for c in set(codes)}
    for response in responses:
        if response.status_code == 429:
            assert "rate limit" in json.loads(response.text)["error"]["message"], response.text
            _retry_after(response)
    assert lane_jobs(rds, model, "v1", "online") == RATE_BURST
