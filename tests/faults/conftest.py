"""Fixtures of the fault tests: stores a test may stop, and APIs and workers bound to them.

The shared fixtures (tests/conftest.py) serve the session's Redis and Postgres; a test that kills
a store gets its own from here, so nothing else in the session notices.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from sluice.migrate import upgrade
from sluice.settings import Settings
from tests.support import ApiServer, WorkerProcess, fresh_database, serving, spawn_worker

from ._support import PostgresServer, RedisServer


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own: free port, own directory, appendonly + fsync always."""
    directory = tmp_path / "redis"
    directory.mkdir()
    server = RedisServer(directory=directory)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def private_postgres() -> Iterator[PostgresServer]:
    """A Postgres cluster of this test's own (initdb, migrated to head), which it may stop."""
    server = PostgresServer.create()
    try:
        server.start()
        upgrade(server.url)
        yield server
    finally:
        server.destroy()


@pytest.fixture
def scratch_database() -> Iterator[str]:
    """A database of its own in the shared Postgres, migrated to head, dropped afterwards."""
    with fresh_database("sluice_f_") as url:
        yield url


@pytest.fixture
def start_api() -> Iterator[Callable[[Settings], ApiServer]]:
    """Serve `create_app(settings)` in process, ready in full; stopped (and checked) at teardown."""
    with ExitStack() as stack:
        yield lambda settings: stack.enter_context(serving(settings))


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """`sluice worker` subprocesses on any stores; SIGTERMed at teardown."""
    started: list[WorkerProcess] = []

    def start(*, redis_url: str, database_url: str, model: str, version: str = "v1",
              env: dict[str, str] | None = None, ready_timeout_s: float = 60.0) -> WorkerProcess:
        log_path = tmp_path / f"worker-{model}-{version}-{len(started)}.log"
        worker = spawn_worker(redis_url=redis_url, database_url=database_url, home=tmp_path, log_path=log_path,
                              model=model, version=version, env=env, ready_timeout_s=ready_timeout_s)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.terminate()
