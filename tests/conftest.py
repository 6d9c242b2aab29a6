"""Shared fixtures over real services: a fresh Postgres database and a dedicated Redis DB per
session, the real API served by uvicorn in a thread, and real `sluice worker` subprocesses.

Nothing here mocks Redis or Postgres. Keys are fixed `sluice:` names, so isolation from other
sessions is by Redis DB index and by database name: each session takes the first free DB from 11
up (a lock key in the base DB says who holds it, so two sessions at once never share or flush
each other's), or exactly `SLUICE_TEST_REDIS_DB`. Within a session, tests isolate themselves by
registering models under unique names.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest
import redis
import uvicorn
from fastapi import FastAPI
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from sluice import keys
from sluice.migrate import upgrade
from sluice.registry.store import Registry, normalise_url
from sluice.seed import Seeded, seed
from sluice.settings import Settings

REPO = Path(__file__).resolve().parents[1]
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_DATABASE_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
# Tried in this order; SLUICE_TEST_REDIS_DB pins one (unlocked).
TEST_REDIS_DBS = (11, 12, 13, 14, 15, *range(1, 11))
FINAL = frozenset({"succeeded", "failed", "expired", "cancelled"})
# Any 64-hex string: the synthetic kind has no file, so its sha256 is never checked.
SYNTHETIC_SHA = "0" * 64
FAST_SYNTHETIC = "fixed_s=0.001&per_item_s=0.0002&per_token_s=0.00001"

# The limits the in-process API runs with (small, so 413 and 422 are cheap to provoke).
MAX_BODY_BYTES = 128 * 1024
MAX_TEXT_CHARS = 5_000
MAX_BULK_ITEMS = 500


# --- stores ----------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def database_url() -> Iterator[str]:
    """A database of its own for this session, migrated to head, dropped at the end."""
    base = make_url(normalise_url(os.environ.get("SLUICE_TEST_DATABASE_URL", DEFAULT_DATABASE_URL)))
    name = f"sluice_t_{secrets.token_hex(6)}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = base.set(database=name).render_as_string(hide_password=False)
    try:
        upgrade(url)
        yield url
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """SLUICE_TEST_REDIS_URL on a DB index of this session's own, flushed at session start."""
    parts = urlsplit(os.environ.get("SLUICE_TEST_REDIS_URL", DEFAULT_REDIS_URL))
    base = redis.Redis.from_url(urlunsplit(parts))
    base_db = int(parts.path.strip("/") or 0)
    token = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
    pinned = os.environ.get("SLUICE_TEST_REDIS_DB")
    lock: str | None = None
    try:
        if pinned:
            db = int(pinned)
        else:
            for db in (d for d in TEST_REDIS_DBS if d != base_db):
                # Expires on its own if a session dies without releasing it.
                if base.set(f"sluice-test:redis-db:{db}", token, nx=True, ex=6 * 3600):
                    lock = f"sluice-test:redis-db:{db}"
                    break
            else:
                raise RuntimeError("every test Redis DB is held by another session")
        url = urlunsplit(parts._replace(path=f"/{db}"))
        with redis.Redis.from_url(url) as client:
            client.flushdb()
        yield url
    finally:
        if lock is not None and base.get(lock) == token.encode():
            base.delete(lock)
        base.close()


@pytest.fixture(scope="session")
def rds(redis_url: str) -> Iterator[redis.Redis]:
    """A plain synchronous client for assertions on the wire contract (str replies)."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture(scope="session")
def registry(database_url: str) -> Iterator[Registry]:
    reg = Registry(url=database_url, pool_size=2)
    yield reg
    reg.dispose()


@pytest.fixture(scope="session")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sluice-home")


@pytest.fixture(scope="session")
def seeded(registry: Registry, home: Path) -> Seeded:
    """Tenant `demo` (plain key), tenant `admin` (admin key), `minilm` v1 and `intent` v1 at 100."""
    return seed(registry, home=home)


@pytest.fixture(scope="session")
def settings(redis_url: str, database_url: str, home: Path) -> Settings:
    return Settings(
        redis_url=redis_url,
        database_url=database_url,
        home=home,
        claim_after_s=5.0,
        max_deliveries=3,
        routing_refresh_s=30.0,
        auth_cache_s=60.0,
        max_body_bytes=MAX_BODY_BYTES,
        max_text_chars=MAX_TEXT_CHARS,
        max_bulk_items=MAX_BULK_ITEMS,
        max_wait_s=30.0,
        shutdown_grace_s=15.0,
    )


# --- the API, in process, over real connections ----------------------------------------------------


@dataclass
class ApiServer:
    """uvicorn serving `create_app(settings)` on its own thread and event loop."""

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
        self.server = uvicorn.Server(config)

        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            assert self.server is not None
            await self.server.serve(sockets=[sock])

        def target() -> None:
            try:
                asyncio.run(main())
            except BaseException as exc:  # reported by start()/stop(), not lost in the thread
                self.error.append(exc)
            finally:
                sock.close()

        self.thread = threading.Thread(target=target, name="sluice-api", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the API did not start: {self.error}")
            time.sleep(0.02)

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


@pytest.fixture(scope="session")
def api(settings: Settings, seeded: Seeded) -> Iterator[ApiServer]:
    from api.app import create_app

    server = ApiServer(app=create_app(settings=settings))
    server.start()
    try:
        # Ready in full: Redis, Postgres, routing loaded and the event subscription live.
        deadline = time.monotonic() + 15
        while True:
            body = httpx.get(f"{server.url}/readyz", timeout=5).json()
            if body["status"] == "ok":
                break
            assert time.monotonic() < deadline, body
            time.sleep(0.05)
        yield server
    finally:
        server.stop()
    assert not server.error, server.error


def _client(base_url: str, key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=base_url, headers=headers, timeout=60.0)


@pytest.fixture(scope="session")
def anon(api: ApiServer) -> Iterator[httpx.Client]:
    with _client(api.url, None) as client:
        yield client


@pytest.fixture(scope="session")
def demo(api: ApiServer, seeded: Seeded) -> Iterator[httpx.Client]:
    with _client(api.url, seeded.demo_key) as client:
        yield client


@pytest.fixture(scope="session")
def admin(api: ApiServer, seeded: Seeded) -> Iterator[httpx.Client]:
    with _client(api.url, seeded.admin_key) as client:
        yield client


@pytest.fixture(scope="session")
def client_for(api: ApiServer) -> Iterator[Callable[[str], httpx.Client]]:
    """Clients for keys minted during the session (closed at the end)."""
    made: list[httpx.Client] = []

    def make(key: str) -> httpx.Client:
        made.append(_client(api.url, key))
        return made[-1]

    yield make
    for client in made:
        client.close()


def unique(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


@pytest.fixture(scope="session")
def new_tenant(
    admin: httpx.Client, client_for: Callable[[str], httpx.Client]
) -> Callable[..., tuple[str, httpx.Client]]:
    """Create a tenant through the admin API; answer its id and a client holding its first key."""

    def make(prefix: str = "tenant") -> tuple[str, httpx.Client]:
        response = admin.post("/v1/tenants", json={"id": unique(prefix)})
        assert response.status_code == 201, response.text
        body = response.json()
        return body["id"], client_for(body["key"]["secret"])

    return make


@pytest.fixture(scope="session")
def register_synthetic(admin: httpx.Client) -> Callable[..., str]:
    """Register a synthetic model under a unique name through the admin API; answer the name.

    `weights` defaults to all traffic on the first version; pass {} for a model with no weight.
    """

    def register(
        prefix: str = "synth",
        *,
        versions: tuple[str, ...] = ("v1",),
        weights: dict[str, float] | None = None,
        cost: str = FAST_SYNTHETIC,
        max_batch_size: int = 32,
        max_wait_ms: float = 10.0,
    ) -> str:
        name = unique(prefix)
        response = admin.post("/v1/models", json={"name": name, "kind": "synthetic"})
        assert response.status_code == 201, response.text
        for version in versions:
            response = admin.post(f"/v1/models/{name}/versions", json={
                "version": version, "artifact": f"synthetic:?{cost}", "sha256": SYNTHETIC_SHA,
                "state": "stable",
                "batching": {"max_batch_size": max_batch_size, "max_wait_ms": max_wait_ms},
            })
            assert response.status_code == 201, response.text
        weights = {versions[0]: 100.0} if weights is None else weights
        if weights:
            response = admin.put(f"/v1/models/{name}/routing", json={"weights": weights, "reason": "test"})
            assert response.status_code == 200, response.text
        return name

    return register


# --- reading jobs and queues ------------------------------------------------------------------------


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


@pytest.fixture(scope="session")
def wait_jobs() -> Callable[..., list[dict[str, Any]]]:
    def wait_all(client: httpx.Client, ids: list[str], *, timeout_s: float = 120.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        return [wait_job(client, i, timeout_s=max(1.0, deadline - time.monotonic())) for i in ids]

    return wait_all


@dataclass(frozen=True)
class QueueState:
    online: int
    bulk: int
    jobs: int


@pytest.fixture(scope="session")
def queue_state(rds: redis.Redis) -> Callable[[str, str], QueueState]:
    """XLEN of a version's two streams and the number of job records in this Redis DB."""

    def snapshot(model: str, version: str) -> QueueState:
        return QueueState(
            online=int(rds.xlen(keys.stream(model, version, "online"))),
            bulk=int(rds.xlen(keys.stream(model, version, "bulk"))),
            jobs=sum(1 for _ in rds.scan_iter(match="sluice:job:*", count=1000)),
        )

    return snapshot


def pending_count(rds: redis.Redis, model: str, version: str) -> int:
    """Entries delivered to the `workers` group and not acknowledged, over both lanes."""
    total = 0
    for lane in keys.LANES:
        stream = keys.stream(model, version, lane)
        if rds.exists(stream):
            groups = {g["name"] for g in rds.xinfo_groups(stream)}  # type: ignore[union-attr]
            if keys.GROUP in groups:
                total += int(rds.xpending(stream, keys.GROUP)["pending"])  # type: ignore[index]
    return total


@pytest.fixture(scope="session")
def pending(rds: redis.Redis) -> Callable[[str, str], int]:
    return lambda model, version: pending_count(rds, model, version)


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
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return int(self.proc.returncode)


def _ready(rds: redis.Redis, worker: WorkerProcess) -> bool:
    for key in rds.scan_iter(match=keys.heartbeat_pattern(worker.model, worker.version), count=1000):
        beat = rds.hgetall(key)
        if beat.get("pid") == str(worker.proc.pid) and beat.get("state") == "ready":  # type: ignore[union-attr]
            return True
    return False


@pytest.fixture
def start_worker(
    redis_url: str, database_url: str, home: Path, rds: redis.Redis, tmp_path: Path, seeded: Seeded
) -> Iterator[Callable[..., WorkerProcess]]:
    """Start `sluice worker` subprocesses; each is ready (heartbeat `ready`) when returned."""
    started: list[WorkerProcess] = []
    logs: list[Any] = []

    def start(model: str, version: str = "v1", *, threads: int = 1, ready_timeout_s: float = 90.0,
              env: dict[str, str] | None = None) -> WorkerProcess:
        environment = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
        environment.update({
            "SLUICE_REDIS_URL": redis_url,
            "SLUICE_DATABASE_URL": database_url,
            "SLUICE_HOME": str(home),
            "SLUICE_CLAIM_AFTER_S": "5",
            "SLUICE_SHUTDOWN_GRACE_S": "15",
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        })
        log_path = tmp_path / f"worker-{model}-{version}-{len(started)}.log"
        sink = log_path.open("wb")
        logs.append(sink)
        proc = subprocess.Popen(
            [sys.executable, "-m", "sluice.cli", "worker", "--model", model, "--version", version,
             "--threads", str(threads)],
            cwd=REPO, env=environment, stdout=sink, stderr=subprocess.STDOUT,
        )
        worker = WorkerProcess(model=model, version=version, proc=proc, log_path=log_path)
        started.append(worker)
        deadline = time.monotonic() + ready_timeout_s
        while not _ready(rds, worker):
            assert proc.poll() is None, f"worker exited with {proc.returncode}:\n{worker.log()}"
            assert time.monotonic() < deadline, f"worker not ready after {ready_timeout_s}s:\n{worker.log()}"
            time.sleep(0.05)
        return worker

    yield start
    for worker in started:
        worker.terminate()
    for sink in logs:
        sink.close()
