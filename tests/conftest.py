"""Shared fixtures over real services: a fresh Postgres database and a dedicated Redis DB per
session, the real API served by uvicorn in a thread, and real `sluice worker` subprocesses.

Nothing here mocks Redis or Postgres. Keys are fixed `sluice:` names, so isolation from other
sessions is by Redis DB index and by database name: each session takes the first free DB from 11
up (a lock key in the base DB says who holds it, so two sessions at once never share or flush
each other's), or exactly `SLUICE_TEST_REDIS_DB`. Within a session, tests isolate themselves by
registering models under unique names. The pieces these fixtures bind live in tests/support.py.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest
import redis
from sqlalchemy import text

from launch.seed import DEMO_VERSIONS, Seeded, seed
from sluice.artifacts import parse_artifact
from sluice.registry.store import Registry
from sluice.settings import Settings
from sluice.vocabulary import LANES
from sluice.wire import keys
from sluice.wire.connections import cluster_url, connect_sync
from tests.support import (
    ApiServer,
    WorkerProcess,
    fresh_database,
    http_client,
    lane_jobs,
    make_settings,
    register_synthetic_model,
    serving,
    spawn_worker,
    unique,
    wait_job,
)
from workers.batches import BatchFeeder

# Tried in this order; SLUICE_TEST_REDIS_DB pins one (unlocked).
TEST_REDIS_DBS = (11, 12, 13, 14, 15, *range(1, 11))
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


# --- stores ----------------------------------------------------------------------------------------


_FIGURES: list[tuple[str, list[tuple[str, object]]]] = []


# --- figures: what a test measured, shown in the terminal summary and in junit properties ---------


@pytest.fixture
def figure(request: pytest.FixtureRequest) -> Callable[[str, object], None]:
    """Record one measured figure (name, value) of this test.

    Written to the node's user_properties (so `--junitxml` carries them, in any junit family,
    which `record_property` does not) and listed in the terminal summary.
    """

    def record(name: str, value: object) -> None:
        request.node.user_properties.append((name, value))

    return record


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" and report.user_properties:
        _FIGURES.append((report.nodeid, list(report.user_properties)))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _FIGURES:
        return
    terminalreporter.section("test figures")
    for nodeid, properties in _FIGURES:
        terminalreporter.write_line(nodeid)
        for name, value in properties:
            terminalreporter.write_line(f"    {name} = {value}")


@pytest.fixture(scope="session")
def database_url() -> Iterator[str]:
    """A database of its own for this session, migrated to head, dropped at the end."""
    with fresh_database("sluice_t_") as url:
        yield url


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """SLUICE_TEST_REDIS_URL on a DB index of this session's own, flushed at session start.

    A cluster URL (`redis+cluster://`, tests/test_cluster.py runs part of the suite so) has one
    database: the session must have the cluster to itself, and flushes all of it."""
    configured = os.environ.get("SLUICE_TEST_REDIS_URL", DEFAULT_REDIS_URL)
    if cluster_url(configured) is not None:
        with connect_sync(configured) as cluster:
            cluster.flushall()
        yield configured
        return
    parts = urlsplit(configured)
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
    client = connect_sync(redis_url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture
def deliveries(rds: redis.Redis) -> Iterator[list[str]]:
    """Delivery ids a test made; taken off the due set afterwards so that no later sweep sends them."""
    made: list[str] = []
    yield made
    for delivery_id in made:
        rds.zrem(keys.WEBHOOK_DUE, delivery_id)
        rds.delete(keys.delivery(delivery_id))


@pytest.fixture(scope="session")
def registry(database_url: str) -> Iterator[Registry]:
    reg = Registry(url=database_url, pool_size=2)
    yield reg
    reg.dispose()


@pytest.fixture
def feeder(settings: Settings) -> Iterator[Callable[..., BatchFeeder]]:
    """Batch feeders (workers/batches.py) on the suite's stores, closed after the test."""
    made: list[BatchFeeder] = []

    def make(**overrides: Any) -> BatchFeeder:
        options: dict[str, Any] = {
            "storage": settings.batch_storage, "batch_root": settings.batch_root, "max_in_flight": 64,
            "max_running": 8, "lease_s": 30.0, "checkpoint_s": 0.2, "result_ttl_s": 600,
            "max_text_chars": settings.max_text_chars, "max_line_bytes": settings.batch_max_line_bytes,
            **overrides,
        }
        made.append(BatchFeeder(redis=connect_sync(settings.require_redis_url()),
                                registry=Registry(url=settings.require_database_url(), pool_size=4), **options))
        return made[-1]

    yield make
    for each in made:
        each.close()


@pytest.fixture(scope="module")
def batches_ended_after(registry: Registry) -> Iterator[None]:
    """After the module: every batch it left unfinished ends and every schedule goes, so that no
    Celery worker of a later module spends its threads feeding them (their models' workers are gone)."""
    yield
    with registry.session() as session:
        session.execute(text("UPDATE batches SET status = 'cancelled', finished_at = now() "
                             "WHERE finished_at IS NULL"))
        session.execute(text("DELETE FROM schedules"))


@pytest.fixture(scope="session")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sluice-home")


@pytest.fixture(scope="session")
def seeded(registry: Registry, home: Path) -> Seeded:
    """Tenant `demo` (plain key), tenant `admin` (admin key), `minilm` v1 and `intent` v1 at 100, in
    fp32: the tests compare outputs with the fp32 reference, and `sluice up`'s tests run `auto`."""
    fp32 = tuple(replace(demo, artifact=parse_artifact(demo.artifact).location) for demo in DEMO_VERSIONS)
    return seed(registry, home=home, versions=fp32)


@pytest.fixture(scope="session")
def settings(redis_url: str, database_url: str, home: Path) -> Settings:
    return make_settings(redis_url=redis_url, database_url=database_url, home=home)


# --- the API, in process, over real connections ----------------------------------------------------


@pytest.fixture(scope="session")
def api(settings: Settings, seeded: Seeded) -> Iterator[ApiServer]:
    """Ready in full: Redis, Postgres, routing loaded and the event subscription live."""
    with serving(settings) as server:
        _SESSION_API.append(server)
        try:
            yield server
        finally:
            _SESSION_API.remove(server)


# A test that uses the session API failed and the API no longer answers: the report of why. The run
# stops on it, since every later test that uses the API would fail too, each after its timeouts.
_SESSION_API: list[ApiServer] = []
_STALLED: list[str] = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    report: pytest.TestReport = yield
    if report.failed and report.when != "teardown" and _SESSION_API and "api" in getattr(item, "fixturenames", ()):
        stalled = _SESSION_API[-1].stall_report()
        if stalled is not None:
            _STALLED.append(stalled)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[object]:
    outcome = yield
    if _STALLED:
        reporter = item.config.pluginmanager.get_plugin("terminalreporter")
        for line in ["", *_STALLED[0].splitlines()]:
            reporter.write_line(line)
        pytest.exit(f"the session API stopped answering after {item.nodeid} failed (its state is above)",
                    returncode=1)
    return outcome


@pytest.fixture(scope="session")
def anon(api: ApiServer) -> Iterator[httpx.Client]:
    with http_client(api.url, None) as client:
        yield client


@pytest.fixture(scope="session")
def demo(api: ApiServer, seeded: Seeded) -> Iterator[httpx.Client]:
    with http_client(api.url, seeded.demo_key) as client:
        yield client


@pytest.fixture(scope="session")
def admin(api: ApiServer, seeded: Seeded) -> Iterator[httpx.Client]:
    with http_client(api.url, seeded.admin_key) as client:
        yield client


@pytest.fixture(scope="session")
def client_for(api: ApiServer) -> Iterator[Callable[[str], httpx.Client]]:
    """Clients for keys minted during the session (closed at the end)."""
    made: list[httpx.Client] = []

    def make(key: str) -> httpx.Client:
        made.append(http_client(api.url, key))
        return made[-1]

    yield make
    for client in made:
        client.close()


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
    """`register_synthetic_model` under a unique name made from a prefix ("synth")."""

    def register(prefix: str = "synth", **options: Any) -> str:
        return register_synthetic_model(admin, unique(prefix), **options)

    return register


# --- reading jobs and queues ------------------------------------------------------------------------


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
    """XLEN of a version's two streams and the number of job records of that version. Only its
    own: jobs of other tests' models come and go (created, expired) while a test looks."""

    def snapshot(model: str, version: str) -> QueueState:
        pipe = rds.pipeline(transaction=False)
        for key in rds.scan_iter(match="sluice:job:*", count=1000):
            pipe.hmget(key, "model", "version")
        owned = sum(1 for fields in pipe.execute() if fields == [model, version])
        return QueueState(
            online=int(lane_jobs(rds, model, version, "online")),
            bulk=int(lane_jobs(rds, model, version, "bulk")),
            jobs=owned,
        )

    return snapshot


def pending_count(rds: redis.Redis, model: str, version: str) -> int:
    """Entries delivered to the `workers` group and not acknowledged, over both lanes."""
    total = 0
    for lane in LANES:
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


@pytest.fixture
def start_worker(
    redis_url: str, database_url: str, home: Path, tmp_path: Path, seeded: Seeded
) -> Iterator[Callable[..., WorkerProcess]]:
    """Start `sluice worker` subprocesses; each is ready (heartbeat `ready`) when returned."""
    started: list[WorkerProcess] = []

    def start(model: str, version: str = "v1", *, threads: int = 1, ready_timeout_s: float = 90.0,
              env: dict[str, str] | None = None) -> WorkerProcess:
        worker = spawn_worker(redis_url=redis_url, database_url=database_url, home=home, model=model,
                              version=version, threads=threads, env=env, ready_timeout_s=ready_timeout_s,
                              log_path=tmp_path / f"worker-{model}-{version}-{len(started)}.log")
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.terminate()
