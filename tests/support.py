"""What the fixtures are built from: the API in process, `sluice worker` subprocesses, fresh
databases, settings, a few REST helpers and a webhook receiver, each parameterised by the store URLs.

tests/conftest.py binds them to the session's Redis and Postgres; tests/faults binds them to
stores a test may stop. Plain functions and classes, so both (and a test that needs a second
API replica) build on one copy.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import redis
import redis.asyncio as aioredis
import uvicorn
from fastapi import FastAPI
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from sluice.kinds import token_estimate
from sluice.migrate import upgrade
from sluice.registry.store import normalise_url
from sluice.settings import Settings
from sluice.vocabulary import Lane
from sluice.wire import events, keys, scripts
from sluice.wire.connections import connect_sync
from sluice.wire.entries import Delivered, StreamEntry
from sluice.wire.jobs import JobRecord, JobStatus
from sluice.wire.keys import new_job_id
from sluice.wire.samples import SAMPLES_MAXLEN, Sample
from sluice.wire.script_calls import Finished, claim_call, finish_call
from sluice.wire.streams import queue_jobs
from workers.worker import Worker

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATABASE_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
FINAL = frozenset({"succeeded", "failed", "expired", "cancelled"})
# Any 64-hex string: the synthetic kind has no file, so its sha256 is never checked.
SYNTHETIC_SHA = "0" * 64
FAST_SYNTHETIC = "fixed_s=0.001&per_item_s=0.0002&per_token_s=0.00001"

# The limits the in-process API runs with (small, so 413 and 422 are cheap to provoke).
MAX_BODY_BYTES = 128 * 1024
MAX_TEXT_CHARS = 5_000
MAX_BULK_ITEMS = 500


def sse_events(response: httpx.Response) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """The (id, event, data) of each event of a `text/event-stream` answer, comments skipped."""
    fields: dict[str, str] = {}
    for line in response.iter_lines():
        if line.startswith(":"):
            continue
        if line:
            name, _, value = line.partition(": ")
            fields[name] = value
            continue
        yield fields["id"], fields["event"], json.loads(fields["data"])
        fields = {}


def celery_broker_env() -> dict[str, str]:
    """SLUICE_CELERY_BROKER_URL for a Celery process of the suite: what SLUICE_TEST_CELERY_BROKER_URL
    names (tests/test_cluster.py sets it: Celery cannot use the cluster), else nothing."""
    url = os.environ.get("SLUICE_TEST_CELERY_BROKER_URL")
    return {"SLUICE_CELERY_BROKER_URL": url} if url else {}


def lane_jobs(rds: redis.Redis, model: str, version: str, lane: Lane) -> int:
    """A lane's jobs not yet settled: its stream's entries and the jobs it holds (queue.lua)."""
    held = rds.hget(keys.held_index(model, version, lane), "*")
    return int(rds.xlen(keys.stream(model, version, lane))) + int(held or 0)  # type: ignore[arg-type]


def lane_job_ids(rds: redis.Redis, model: str, version: str, lane: Lane) -> set[str]:
    """The ids of a lane's jobs in its stream and held beside it (queue.lua): where an accepted job
    waits for a worker."""
    ids: set[str] = set()
    for _, fields in rds.xrange(keys.stream(model, version, lane)):  # type: ignore[union-attr]
        job_id = fields["id"]
        ids.add(job_id if isinstance(job_id, str) else job_id.decode())
    prefix = keys.held_queue_prefix(model, version, lane)
    for queue in rds.scan_iter(match=prefix.replace("{", "[{]").replace("}", "[}]") + "*"):
        for job_key in rds.lrange(queue, 0, -1):  # type: ignore[union-attr]
            text = job_key if isinstance(job_key, str) else job_key.decode()
            ids.add(text.rsplit("}:", 1)[1])
    return ids


async def lane_jobs_async(redis: aioredis.Redis, model: str, version: str, lane: Lane) -> int:
    held = await redis.hget(keys.held_index(model, version, lane), "*")  # type: ignore[misc]
    return int(await redis.xlen(keys.stream(model, version, lane))) + int(held or 0)


def wait_until(predicate: Callable[[], bool], *, timeout_s: float, what: str, interval_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout_s}s")
        time.sleep(interval_s)


def stop_process(proc: subprocess.Popen[bytes] | None, sig: int, timeout_s: float = 20.0) -> None:
    """Send `sig`, wait, then SIGKILL if the process did not leave."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


# --- stores and settings ---------------------------------------------------------------------------


@dataclass
class CeleryWorker:
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def celery_worker_env(*, redis_url: str, database_url: str, home: Path, **settings: str) -> dict[str, str]:
    """The environment of a test's Celery worker: this process's, less its own SLUICE_ settings, with
    the session's stores and home, callbacks allowed to 127.0.0.0/8, and `settings` (SLUICE_ names)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    env.update({
        "SLUICE_REDIS_URL": redis_url, "SLUICE_DATABASE_URL": database_url, "SLUICE_HOME": str(home),
        "SLUICE_WEBHOOK_ALLOWED_NETWORKS": "127.0.0.0/8", "PYTHONUNBUFFERED": "1", **celery_broker_env(),
        **settings,
    })
    return env


@contextmanager
def celery_worker_process(env: dict[str, str], *, log_path: Path, name: str) -> Iterator[CeleryWorker]:
    """`celery -A workers.tasks worker --beat` on four threads, every queue, until its outbox relay is up."""
    with log_path.open("wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "workers.tasks", "worker", "--beat", "--pool", "threads",
             "--concurrency", "4", "--hostname", f"{name}-{secrets.token_hex(3)}@%h", "--without-mingle",
             "--without-gossip", "--loglevel", "INFO"],
            cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT,
        )
    worker = CeleryWorker(proc=proc, log_path=log_path)
    try:
        wait_until(lambda: proc.poll() is not None or ("outbox relay" in worker.log() and " ready." in worker.log()),
                   timeout_s=60, what="the Celery worker")
        assert proc.poll() is None, worker.log()
        yield worker
    finally:
        stop_process(proc, signal.SIGTERM, timeout_s=30)


@contextmanager
def fresh_database(prefix: str, revision: str | None = "head") -> Iterator[str]:
    """A database of its own in the shared Postgres, migrated to `revision` (None: left empty),
    dropped afterwards."""
    base = make_url(normalise_url(os.environ.get("SLUICE_TEST_DATABASE_URL", DEFAULT_DATABASE_URL)))
    name = f"{prefix}{secrets.token_hex(6)}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = base.set(database=name).render_as_string(hide_password=False)
    try:
        if revision is not None:
            upgrade(url, revision)
        yield url
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def make_settings(*, redis_url: str, database_url: str, home: Path, **overrides: Any) -> Settings:
    """The settings every in-process API of the suite runs with, on the given stores."""
    values: dict[str, Any] = {
        "redis_url": redis_url, "database_url": database_url, "home": home, "claim_after_s": 5.0,
        "max_deliveries": 3, "routing_refresh_s": 30.0, "auth_cache_s": 60.0, "max_body_bytes": MAX_BODY_BYTES,
        "max_text_chars": MAX_TEXT_CHARS, "max_bulk_items": MAX_BULK_ITEMS, "max_wait_s": 30.0,
        "shutdown_grace_s": 15.0,
        # Most suite models have no worker for minutes on end by design (rejection tests, queued
        # jobs); the breaker's no-worker trip is tested with its own API (test_shadow_breaker).
        "breaker_no_worker_grace_s": 3600.0,
        "batch_root": home / "batch-root",
    }
    values.update(overrides)
    return Settings(**values)


# --- the API, in process, over real connections ----------------------------------------------------


@dataclass
class ApiServer:
    """uvicorn serving an app on its own thread and event loop."""

    app: FastAPI
    url: str = ""
    loop: asyncio.AbstractEventLoop | None = None
    server: uvicorn.Server | None = None
    thread: threading.Thread | None = None
    error: list[BaseException] = field(default_factory=list)

    def start(self) -> None:
        # proto=IPPROTO_TCP matters: asyncio only sets TCP_NODELAY on accepted sockets whose
        # listener says TCP, and without it every response waits ~40 ms for a delayed ACK.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(self.app, lifespan="on", ws="none", log_config=None, access_log=False,
                                timeout_graceful_shutdown=5)
        server = self.server = uvicorn.Server(config)

        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            await server.serve(sockets=[sock])

        def target() -> None:
            try:
                asyncio.run(main())
            except BaseException as exc:  # reported by start()/stop(), not lost in the thread
                self.error.append(exc)
            finally:
                sock.close()

        thread = self.thread = threading.Thread(target=target, name="sluice-api", daemon=True)
        thread.start()
        wait_until(lambda: server.started or not thread.is_alive(), timeout_s=30, what="the API")
        if self.error or not server.started:
            raise RuntimeError(f"the API did not start: {self.error}")

    def stop(self) -> None:
        if self.server is not None and self.thread is not None:
            self.server.should_exit = True
            self.thread.join(timeout=20)
            assert not self.thread.is_alive(), "the API did not stop"

    def reload_routing(self) -> None:
        """Make the running API re-read the registry now (after a direct registry change)."""
        assert self.loop is not None
        state = self.app.state.sluice
        future = asyncio.run_coroutine_threadsafe(state.routing.reload(), self.loop)
        assert future.result(timeout=10), "routing reload failed"

    def readyz(self) -> dict[str, Any]:
        response = httpx.get(f"{self.url}/readyz", timeout=10)
        body: dict[str, Any] = response.json()
        body["_status_code"] = response.status_code
        return body

    def stall_report(self, *, timeout_s: float = 30.0) -> str | None:
        """None once `/readyz` answers 200 within `timeout_s`; otherwise what the API's thread, its
        event loop's tasks and its connection pools are doing. A session API that stops answering
        would fail every later test only after each test's own timeouts: this names the cause."""
        deadline = time.monotonic() + timeout_s
        problem = "never asked"
        while time.monotonic() < deadline:
            try:
                response = httpx.get(f"{self.url}/readyz", timeout=max(1.0, deadline - time.monotonic()))
            except httpx.HTTPError as exc:
                problem = f"/readyz did not answer: {exc!r}"
                continue
            if response.status_code == 200:
                return None
            problem = f"/readyz answered {response.status_code}: {response.text[:500]}"
            time.sleep(0.5)
        lines = [f"the session API is not ready after {timeout_s:.0f} s ({problem})"]
        frame = sys._current_frames().get(self.thread.ident or 0) if self.thread else None
        if frame is not None:
            lines += ["its thread:", *traceback.format_stack(frame)]
        if self.loop is not None:
            try:
                tasks = list(asyncio.all_tasks(self.loop))
            except RuntimeError as exc:  # the set changed under us, read from another thread
                tasks, lines = [], [*lines, f"its tasks could not be listed: {exc}"]
            lines.append(f"its event loop has {len(tasks)} task(s):")
            for task in tasks:
                lines.append(f"  {task.get_name()}: {task.get_coro()!r}")
                lines += [f"    {line}" for frame in task.get_stack(limit=4)
                          for line in traceback.format_stack(frame, 1)]
        state = getattr(self.app.state, "sluice", None)
        if state is not None:
            pool = state.broker.redis.connection_pool
            lines.append(f"its Redis pool: {len(getattr(pool, '_in_use_connections', ()))} in use of "
                         f"{getattr(pool, 'max_connections', '?')}")
            lines.append(f"its Postgres pool: {state.registry.engine.pool.status()}")
        return "\n".join(lines)

    def wait_ready(self, status: str = "ok", *, timeout_s: float = 20.0) -> dict[str, Any]:
        """Wait for `/readyz` to say `status` (`ok`: the event subscription is live too)."""
        deadline = time.monotonic() + timeout_s
        while True:
            body = self.readyz()
            if body["status"] == status:
                return body
            assert time.monotonic() < deadline, f"/readyz never said {status!r}: {body}"
            time.sleep(0.05)


@contextmanager
def serving(settings: Settings) -> Iterator[ApiServer]:
    """`create_app(settings)` served in process and ready in full; stopped and checked on exit."""
    from api.app import create_app

    server = ApiServer(app=create_app(settings=settings))
    server.start()
    try:
        server.wait_ready("ok")
        yield server
    finally:
        server.stop()
    assert not server.error, server.error


def record_failures(rds: redis.Redis, model: str, version: str, count: int) -> None:
    """Finished-job samples as `version`'s workers write them after `count` failed jobs (what its
    breaker and guardrails read), without running a worker."""
    failed = Sample(status="failed", finished_at=time.time(), queue_wait_ms=1.0, model_ms=1.0, total_ms=2.0,
                    batch_size=1, close_reason="size")
    pipe = rds.pipeline(transaction=False)
    for _ in range(count):
        pipe.xadd(keys.stats(model, version), failed.to_fields(),  # type: ignore[arg-type]
                  maxlen=SAMPLES_MAXLEN, approximate=True)
    pipe.execute()


def http_client(base_url: str, key: str | None, *, timeout_s: float = 60.0) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=base_url, headers=headers, timeout=timeout_s)


# --- registry and jobs over REST -------------------------------------------------------------------


def unique(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


def register_synthetic_model(
    admin: httpx.Client, name: str, *, versions: tuple[str, ...] = ("v1",), weights: dict[str, float] | None = None,
    cost: str = FAST_SYNTHETIC, max_batch_size: int = 32, max_wait_ms: float = 10.0,
) -> str:
    """Register a synthetic model with stable versions through the admin API; answer its name.

    `weights` defaults to all traffic on the first version; pass {} for a model with no weight.
    """
    response = admin.post("/v1/models", json={"name": name, "kind": "synthetic"})
    assert response.status_code == 201, response.text
    for version in versions:
        response = admin.post(f"/v1/models/{name}/versions", json={
            "version": version, "artifact": f"synthetic:?{cost}", "sha256": SYNTHETIC_SHA, "state": "stable",
            "batching": {"max_batch_size": max_batch_size, "max_wait_ms": max_wait_ms},
        })
        assert response.status_code == 201, response.text
    weights = {versions[0]: 100.0} if weights is None else weights
    if weights:
        response = admin.put(f"/v1/models/{name}/routing", json={"weights": weights, "reason": "test"})
        assert response.status_code == 200, response.text
    return name


def wait_job(client: httpx.Client, job_id: str, *, timeout_s: float = 60.0) -> dict[str, Any]:
    """Long-poll one job until it is final; fail the test if it is not within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        response = client.get(f"/v1/jobs/{job_id}", params={"wait": max(0.1, min(10.0, remaining))})
        assert response.status_code == 200, response.text
        job: dict[str, Any] = response.json()
        if job["status"] in FINAL:
            return job
        assert remaining > 0, f"job {job_id} still {job['status']} after {timeout_s}s"


# --- real worker processes ---------------------------------------------------------------------------


@dataclass
class WorkerProcess:
    model: str
    version: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self, tail: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-tail:]

    def terminate(self, *, timeout_s: float = 30.0) -> int:
        """SIGTERM (drain), wait, then SIGKILL if it did not leave; answer the exit code."""
        stop_process(self.proc, signal.SIGTERM, timeout_s)
        return int(self.proc.returncode)


def worker_ready(rds: redis.Redis, worker: WorkerProcess) -> bool:
    for key in rds.scan_iter(match=keys.heartbeat_pattern(worker.model, worker.version), count=1000):
        beat = rds.hgetall(key)
        if beat.get("pid") == str(worker.proc.pid) and beat.get("state") == "ready":  # type: ignore[union-attr]
            return True
    return False


def spawn_worker(*, redis_url: str, database_url: str, home: Path, log_path: Path, model: str,
                 version: str = "v1", threads: int = 1, env: dict[str, str] | None = None,
                 ready_timeout_s: float = 90.0) -> WorkerProcess:
    """Start `sluice worker` against the given stores; answer once its heartbeat says `ready`."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    environment.update({
        "SLUICE_REDIS_URL": redis_url, "SLUICE_DATABASE_URL": database_url, "SLUICE_HOME": str(home),
        "SLUICE_CLAIM_AFTER_S": "5", "SLUICE_SHUTDOWN_GRACE_S": "15", "PYTHONUNBUFFERED": "1",
        **(env or {}),
    })
    with log_path.open("ab") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "launch.cli", "worker", "--model", model, "--version", version,
             "--threads", str(threads)],
            cwd=REPO, env=environment, stdout=sink, stderr=subprocess.STDOUT,
        )
    worker = WorkerProcess(model=model, version=version, proc=proc, log_path=log_path)
    rds = connect_sync(redis_url, decode_responses=True)
    try:
        deadline = time.monotonic() + ready_timeout_s
        while not worker_ready(rds, worker):
            assert proc.poll() is None, f"worker exited with {proc.returncode}:\n{worker.log()}"
            assert time.monotonic() < deadline, f"worker not ready after {ready_timeout_s}s:\n{worker.log()}"
            time.sleep(0.05)
    except BaseException:
        worker.terminate(timeout_s=5)
        raise
    finally:
        rds.close()
    return worker


# --- workers in this process, over real Redis --------------------------------------------------------


async def queue_in_redis(redis: aioredis.Redis, model: str, inputs: list[dict[str, Any]], *, version: str = "v1",
                         tenant: str = "demo", shadow: str | None = None) -> list[str]:
    """Queue jobs as the API does (record, then stream entry), without the API; answer their ids."""
    now = time.time()
    records = [JobRecord(id=new_job_id(model, version), tenant=tenant, model=model, version=version, lane="online",
                         status=JobStatus.queued, input=given, enqueued_at=now, cost=token_estimate(given["text"]),
                         shadow=shadow) for given in inputs]
    pipe = redis.pipeline(transaction=False)
    queue_jobs(pipe, records, result_ttl_s=3600)
    await pipe.execute()
    return [record.id for record in records]


def claim_one(rds: redis.Redis, model: str, job_id: str, tenant: str, *, worker: str = "worker-x") -> list[Any]:
    """What a worker's claim does to one job (StreamConsumer.claim, with a made-up entry id): the
    claim script, then its quota place freed (`streams.free_places`); its verdict, `[verdict, ...]`."""
    delivered = Delivered("online", "0-1", StreamEntry(job_id=job_id, tenant=tenant, cost=1, enqueued_at=time.time()))
    script_keys, args = claim_call(model, "v1", [delivered], now=time.time(), worker=worker, max_deliveries=3,
                                   channel=events.channel(rds))
    [verdict] = rds.eval(scripts.CLAIM, len(script_keys), *script_keys, *args)  # type: ignore[misc]
    rds.zrem(keys.queued_jobs(tenant), job_id)
    return verdict  # type: ignore[no-any-return]


def finish_one_call(rds: redis.Redis | Any, model: str, job_id: str, output: str) -> list[Any]:
    """finish.lua's arguments after `numkeys` for one job a worker ran and succeeded (with a
    made-up entry id): `rds.eval(scripts.FINISH, *finish_one_call(...))` answers `[1]` if its write won."""
    now = time.time()
    sample = Sample(status="succeeded", finished_at=now, queue_wait_ms=1.0, model_ms=1.0, total_ms=1.0, batch_size=1,
                    close_reason="size")
    job = Finished(job_id=job_id, lane="online", entry_id="0-1", status="succeeded", output=output, error="",
                   sample=sample)
    script_keys, args = finish_call(model, "v1", [job], channel=events.channel(rds), result_ttl_s=3600, started=now,
                                    finished=now, model_ms=1.0, batch_size=1, close_reason="size")
    return [len(script_keys), *script_keys, *args]


async def drive(workers: list[Worker], redis: aioredis.Redis, ids: list[str], *,
                timeout_s: float) -> dict[str, dict[str, str]]:
    """Run in-process workers until every job of `ids` is final, drain them; answer the records."""
    tasks = [asyncio.create_task(worker.run()) for worker in workers]
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            pipe = redis.pipeline(transaction=False)
            for job_id in ids:
                pipe.hgetall(keys.job(job_id))
            records = {job_id: {k.decode(): v.decode() for k, v in raw.items()}
                       for job_id, raw in zip(ids, await pipe.execute(), strict=True)}
            if all(record.get("status") in FINAL for record in records.values()):
                return records
            failed = [task for task in tasks if task.done()]
            assert not failed, [task.exception() for task in failed]
            assert time.monotonic() < deadline, f"jobs not final after {timeout_s}s"
            await asyncio.sleep(0.1)
    finally:
        for worker in workers:
            worker.request_stop()
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)


# --- a webhook receiver ---------------------------------------------------------------------------


@dataclass
class Received:
    path: str
    headers: dict[str, str]  # lower-case names
    body: bytes
    at: float


@dataclass
class Receiver:
    """Records every POST; answers each path from its plan of statuses (then 200)."""

    url: str = ""
    requests: list[Received] = field(default_factory=list)
    plans: dict[str, list[int]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def plan(self, path: str, *statuses: int) -> str:
        with self.lock:
            self.plans[path] = list(statuses)
        return f"{self.url}{path}"

    def received(self, path: str) -> list[Received]:
        with self.lock:
            return [r for r in self.requests if r.path == path]

    def wait_for(self, path: str, count: int, *, timeout_s: float = 30.0) -> list[Received]:
        wait_until(lambda: len(self.received(path)) >= count, timeout_s=timeout_s,
                   what=f"{count} webhook(s) on {path}")
        return self.received(path)


@contextmanager
def receiving() -> Iterator[Receiver]:
    """A webhook receiver on 127.0.0.1 for the duration of the block."""
    state = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            path = urlsplit(self.path).path
            with state.lock:
                state.requests.append(Received(path, {k.lower(): v for k, v in self.headers.items()}, body,
                                               time.monotonic()))
                plan = state.plans.get(path)
                status = plan.pop(0) if plan else 200
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *_: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="webhook-receiver", daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def measured_precisions(offered: tuple[str, ...]) -> set[str]:
    """The precisions a load times of those the host offers: all of them, or none where fp32 is the
    only one (a host without bf16 or VNNI: nothing to choose between)."""
    return set(offered) if len(offered) > 1 else set()
