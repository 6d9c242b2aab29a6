"""The embedded Valkey and Postgres of `sluice up`: start, persist across restarts, clean up."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa

from launch.embedded import EmbeddedStores, start_embedded

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _wait_dead(pids: list[int], timeout: float = 40.0) -> None:
    deadline = time.monotonic() + timeout
    while any(_alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"still running: {[p for p in pids if _alive(p)]}"
        time.sleep(0.1)


def _server_pids(home: Path) -> list[int]:
    return [int((home / "run" / f"{name}.pid").read_text()) for name in ("valkey", "postgres")]


def _write(stores: EmbeddedStores, value: str) -> None:
    client = redis.Redis.from_url(stores.redis_url)
    try:
        client.set("embedded:key", value)
    finally:
        client.close()
    engine = sa.create_engine(stores.database_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE IF NOT EXISTS t (v text)"))
            conn.execute(sa.text("INSERT INTO t (v) VALUES (:v)"), {"v": value})
    finally:
        engine.dispose()


def _read(stores: EmbeddedStores) -> tuple[bytes | None, list[str]]:
    client = redis.Redis.from_url(stores.redis_url)
    try:
        key = client.get("embedded:key")
    finally:
        client.close()
    engine = sa.create_engine(stores.database_url)
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT 1")).scalar() == 1
            rows = [r[0] for r in conn.execute(sa.text("SELECT v FROM t ORDER BY v"))]
    finally:
        engine.dispose()
    return key, rows


@pytest.fixture
def home() -> Iterator[Path]:
    # Not tmp_path: as root, Postgres runs under another account that must reach PGDATA, and
    # every pytest session resets /tmp/pytest-of-root to 0700, so a concurrent session would
    # take that access away mid-test.
    base = Path(tempfile.mkdtemp(prefix="sluice-embedded-"))
    try:
        yield base / "home"
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_start_write_restart_and_read_back(home: Path) -> None:
    stores = start_embedded(home=home, redis_url=None, database_url=None)
    try:
        assert stores.redis_url.startswith("redis://127.0.0.1:")
        assert stores.database_url.startswith("postgresql+psycopg://postgres@127.0.0.1:")
        assert stores.database_url.endswith("/sluice")
        _write(stores, "first")
        pids = _server_pids(home)
    finally:
        stores.stop()
    stores.stop()  # idempotent
    _wait_dead(pids, timeout=1.0)
    assert (home / "valkey").is_dir()
    assert (home / "postgres" / "PG_VERSION").is_file()
    assert (home / "logs" / "valkey.log").stat().st_size > 0
    assert (home / "logs" / "postgres.log").stat().st_size > 0

    stores = start_embedded(home=home, redis_url=None, database_url=None)
    try:
        assert _read(stores) == (b"first", ["first"])
    finally:
        stores.stop()


def test_given_urls_are_passed_through(home: Path) -> None:
    stores = start_embedded(home=home, redis_url="redis://elsewhere:6379/0", database_url="postgresql+psycopg://x@y/z")
    assert stores.redis_url == "redis://elsewhere:6379/0"
    assert stores.database_url == "postgresql+psycopg://x@y/z"
    stores.stop()
    assert not home.exists()


def _start_in_child(home: Path) -> tuple[subprocess.Popen[str], dict[str, str]]:
    code = (
        "import json, sys, time\n"
        "from pathlib import Path\n"
        "from launch.embedded import start_embedded\n"
        "s = start_embedded(home=Path(sys.argv[1]), redis_url=None, database_url=None)\n"
        "print(json.dumps({'redis': s.redis_url, 'db': s.database_url}), flush=True)\n"
        "time.sleep(600)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(home)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line, "child failed to start the embedded stores"
    return child, json.loads(line)


def _kill(child: subprocess.Popen[str]) -> None:
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert child.stdout is not None
    child.stdout.close()


def test_servers_stop_when_the_parent_is_killed(home: Path) -> None:
    child, urls = _start_in_child(home)
    stores = EmbeddedStores(redis_url=urls["redis"], database_url=urls["db"])
    _write(stores, "before-kill")
    pids = _server_pids(home)
    _kill(child)
    _wait_dead(pids)

    stores = start_embedded(home=home, redis_url=None, database_url=None)
    try:
        assert _read(stores) == (b"before-kill", ["before-kill"])
    finally:
        stores.stop()


def test_restart_after_parent_and_watchdog_were_killed(home: Path) -> None:
    # Nothing stopped the servers: the next start must take over the orphans itself.
    child, urls = _start_in_child(home)
    _write(EmbeddedStores(redis_url=urls["redis"], database_url=urls["db"]), "orphaned")
    pids = _server_pids(home)
    watchdog = int((home / "run" / "watchdog.pid").read_text())
    os.kill(watchdog, signal.SIGKILL)
    _kill(child)
    time.sleep(0.5)
    assert all(_alive(pid) for pid in pids)

    stores = start_embedded(home=home, redis_url=None, database_url=None)
    try:
        assert not any(_alive(pid) for pid in pids)
        assert _read(stores) == (b"orphaned", ["orphaned"])
    finally:
        stores.stop()


def test_stale_pid_files_pointing_at_unrelated_processes(home: Path) -> None:
    stores = start_embedded(home=home, redis_url=None, database_url=None)
    _write(stores, "stale")
    stores.stop()
    # A killed run leaves pid files behind; by the next start the pids may belong to anything.
    # PID 1 is alive and owned by root, which Postgres alone would take for a live postmaster.
    data_pid = home / "postgres" / "postmaster.pid"
    data_pid.write_text(f"1\n{home / 'postgres'}\n0\n5432\n\n127.0.0.1\n  0  0\nready\n")
    (home / "run" / "valkey.pid").write_text(f"{os.getpid()}\n")
    (home / "run" / "postgres.pid").write_text("1\n")

    stores = start_embedded(home=home, redis_url=None, database_url=None)
    try:
        assert _read(stores) == (b"stale", ["stale"])
    finally:
        stores.stop()


def test_a_busy_home_is_refused_and_a_port_in_use_is_reported(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from launch import embedded
    from sluice.errors import BrokerUnavailable, RegistryUnavailable

    stores = start_embedded(home=home, redis_url=None, database_url=None)
    try:
        monkeypatch.setattr(embedded, "LOCK_WAIT_S", 0.5)
        with pytest.raises(BrokerUnavailable, match="in use by another process"):
            start_embedded(home=home, redis_url=None, database_url=None)
        port = int(stores.redis_url.rsplit(":", 1)[1].split("/")[0])
        with pytest.raises(RegistryUnavailable, match=f"port {port} is already in use"):
            start_embedded(
                home=home.with_name("other"),
                redis_url="redis://x",
                database_url=None,
                postgres_port=port,
            )
    finally:
        stores.stop()


def test_a_free_port_taken_before_the_server_binds_it_is_retried(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from launch import embedded

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        ports = iter([taken])
        real_free_port = embedded.free_port
        monkeypatch.setattr(embedded, "free_port", lambda: next(ports, None) or real_free_port())
        stores = start_embedded(home=home, redis_url=None, database_url="postgresql://unused")
        try:
            assert not stores.redis_url.startswith(f"redis://127.0.0.1:{taken}/")
            client = redis.Redis.from_url(stores.redis_url)
            assert client.ping()
            client.close()
        finally:
            stores.stop()
