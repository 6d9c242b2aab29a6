"""Helpers for the fault tests: stores this suite starts and stops itself, an in-process API bound
to them, and `sluice worker` subprocesses pointed at any Redis.

The patterns follow tests/conftest.py (which other tests share and this suite must not edit);
they are copied here, parameterised by the store URLs, because the shared fixtures are bound to
the session's Redis and Postgres, which a fault test must not stop.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis
import uvicorn
from fastapi import FastAPI

from sluice import keys
from sluice.settings import Settings

REPO = Path(__file__).resolve().parents[2]
FINAL = frozenset({"succeeded", "failed", "expired", "cancelled"})
SYNTHETIC_SHA = "ab" * 32
REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
PG_BIN = Path(os.environ.get("SLUICE_TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_until(predicate: Any, *, timeout_s: float, what: str, interval_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout_s}s")
        time.sleep(interval_s)


def _stop_process(proc: subprocess.Popen[bytes] | None, sig: int, timeout_s: float = 20.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def make_settings(*, redis_url: str, database_url: str, home: Path, **overrides: Any) -> Settings:
    """The shape of the session's settings (tests/conftest.py), on other stores."""
    values: dict[str, Any] = {
        "redis_url": redis_url, "database_url": database_url, "home": home, "claim_after_s": 5.0,
        "max_deliveries": 3, "routing_refresh_s": 30.0, "auth_cache_s": 60.0, "max_body_bytes": 128 * 1024,
        "max_text_chars": 5_000, "max_bulk_items": 500, "max_wait_s": 30.0, "shutdown_grace_s": 15.0,
    }
    values.update(overrides)
    return Settings(**values)


# --- a Redis of our own -----------------------------------------------------------------------------


@dataclass
class RedisServer:
    """`redis-server` on its own port and directory, with an fsync-always append-only file."""

    directory: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.directory / "redis.log"

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.starts += 1
        with self.log_path.open("ab") as sink:
            self.proc = subprocess.Popen(
                [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
                 "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--daemonize", "no",
                 "--protected-mode", "no", "--logfile", ""],
                stdout=sink, stderr=subprocess.STDOUT,
            )
        _wait_until(self.ping, timeout_s=20, what=f"redis-server on port {self.port}")

    def ping(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            return False
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.5, socket_timeout=0.5)
        try:
            return bool(client.ping())
        except redis.exceptions.RedisError:
            return False
        finally:
            client.close()

    def stop(self) -> None:
        """SIGTERM: Redis' orderly shutdown (the append-only file is already fsynced)."""
        _stop_process(self.proc, signal.SIGTERM)

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, decode_responses=True)


# --- a Postgres of our own ------------------------------------------------------------------------------


def _postgres_account() -> tuple[int, int] | None:
    """Postgres refuses to run as root: use the distribution's `postgres` account then."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            continue
        return entry.pw_uid, entry.pw_gid
    raise RuntimeError("running as root and no account to run Postgres as")


@dataclass
class PostgresServer:
    """A throwaway cluster (initdb into a fresh directory under /tmp) that a test can stop."""

    root: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    account: tuple[int, int] | None = None

    @classmethod
    def create(cls) -> PostgresServer:
        # Not under pytest's tmp_path: that lives below a 0700 directory the account cannot enter.
        root = Path(tempfile.mkdtemp(prefix="sluice-faults-pg-", dir="/tmp"))
        server = cls(root=root, account=_postgres_account())
        if server.account:
            os.chown(root, *server.account)
        server._run([str(PG_BIN / "initdb"), "-D", str(server.data), "-U", "postgres", "--auth=trust",
                     "--encoding=UTF8", "--locale=C", "--no-sync"])
        return server

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def log_path(self) -> Path:
        return self.root / "server.log"

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _popen(self, argv: list[str]) -> subprocess.Popen[bytes]:
        sink = self.log_path.open("ab")
        try:
            user = group = None
            if self.account:
                user, group = self.account
            return subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, cwd="/", user=user, group=group,
                                    env={"PATH": os.environ.get("PATH", ""), "LC_ALL": "C"})
        finally:
            sink.close()

    def _run(self, argv: list[str]) -> None:
        proc = self._popen(argv)
        if proc.wait(timeout=180) != 0:
            raise RuntimeError(f"{argv[0]} failed:\n{self.log_path.read_text(errors='replace')[-3000:]}")

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.proc = self._popen([
            str(PG_BIN / "postgres"), "-D", str(self.data), "-c", "listen_addresses=127.0.0.1",
            "-c", f"port={self.port}", "-c", "unix_socket_directories=", "-c", "fsync=off",
            "-c", "full_page_writes=off", "-c", "synchronous_commit=off",
        ])
        _wait_until(self.accepting, timeout_s=60, what=f"Postgres on port {self.port}", interval_s=0.1)

    def accepting(self) -> bool:
        import psycopg

        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"Postgres exited:\n{self.log_path.read_text(errors='replace')[-3000:]}")
        try:
            with psycopg.connect(host="127.0.0.1", port=self.port, user="postgres", dbname="postgres",
                                 connect_timeout=2):
                return True
        except psycopg.OperationalError:
            return False

    def stop(self) -> None:
        """SIGINT is Postgres' fast shutdown: sessions are aborted, then it checkpoints and exits."""
        _stop_process(self.proc, signal.SIGINT, timeout_s=60)

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


# --- the API, in process ---------------------------------------------------------------------------------


@dataclass
class ApiServer:
    """uvicorn serving an app on its own thread and event loop (as tests/conftest.py does)."""

    app: FastAPI
    url: str = ""
    loop: asyncio.AbstractEventLoop | None = None
    server: uvicorn.Server | None = None
    thread: threading.Thread | None = None
    error: list[BaseException] = field(default_factory=list)

    def start(self) -> None:
        # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY only on sockets whose proto says TCP,
        # and with proto 0 every keep-alive response waits ~40 ms on Nagle + delayed ACK.
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
            except BaseException as exc:
                self.error.append(exc)
            finally:
                sock.close()

        self.thread = threading.Thread(target=target, name="sluice-faults-api", daemon=True)
        self.thread.start()
        _wait_until(lambda: bool(self.server and self.server.started) or not self.thread.is_alive(),  # type: ignore[union-attr]
                    timeout_s=30, what="the API")
        if self.error or not self.server.started:
            raise RuntimeError(f"the API did not start: {self.error}")

    def stop(self) -> None:
        if self.server is not None and self.thread is not None:
            self.server.should_exit = True
            self.thread.join(timeout=20)
            assert not self.thread.is_alive(), "the API did not stop"

    def reload_routing(self) -> None:
        assert self.loop is not None
        state = self.app.state.sluice
        future = asyncio.run_coroutine_threadsafe(state.routing.reload(), self.loop)
        assert future.result(timeout=10), "routing reload failed"

    def readyz(self) -> dict[str, Any]:
        response = httpx.get(f"{self.url}/readyz", timeout=10)
        body: dict[str, Any] = response.json()
        body["_status_code"] = response.status_code
        return body

    def wait_ready(self, status: str = "ok", *, timeout_s: float = 20.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            body = self.readyz()
            if body["status"] == status:
                return body
            assert time.monotonic() < deadline, f"/readyz never said {status!r}: {body}"
            time.sleep(0.1)


def client(base_url: str, key: str | None, *, timeout_s: float = 60.0) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=base_url, headers=headers, timeout=timeout_s)


# --- jobs ---------------------------------------------------------------------------------------------------


def wait_job(api: httpx.Client, job_id: str, *, timeout_s: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        response = api.get(f"/v1/jobs/{job_id}", params={"wait": max(0.1, min(10.0, remaining))})
        assert response.status_code == 200, response.text
        job: dict[str, Any] = response.json()
        if job["status"] in FINAL:
            return job
        assert remaining > 0, f"job {job_id} still {job['status']} after {timeout_s}s"


def wait_statuses(rds: redis.Redis, ids: Iterable[str], *, timeout_s: float,
                  final: frozenset[str] = FINAL) -> dict[str, dict[str, str]]:
    """Poll the job hashes straight from Redis until every job is final; answer the records."""
    ids = list(ids)
    deadline = time.monotonic() + timeout_s
    while True:
        records = read_jobs(rds, ids)
        open_ = [i for i, r in records.items() if r.get("status") not in final]
        if not open_:
            return records
        if time.monotonic() > deadline:
            sample = {i: records[i].get("status") for i in open_[:5]}
            raise AssertionError(f"{len(open_)} of {len(ids)} jobs not final after {timeout_s}s, e.g. {sample}")
        time.sleep(0.2)


def read_jobs(rds: redis.Redis, ids: Iterable[str]) -> dict[str, dict[str, str]]:
    ids = list(ids)
    pipe = rds.pipeline(transaction=False)
    for job_id in ids:
        pipe.hgetall(keys.job(job_id))
    return dict(zip(ids, pipe.execute(), strict=True))


def register_synthetic(admin: httpx.Client, name: str, *, cost: str, max_batch_size: int = 32,
                       max_wait_ms: float = 10.0, version: str = "v1") -> str:
    response = admin.post("/v1/models", json={"name": name, "kind": "synthetic"})
    assert response.status_code == 201, response.text
    response = admin.post(f"/v1/models/{name}/versions", json={
        "version": version, "artifact": f"synthetic:?{cost}", "sha256": SYNTHETIC_SHA, "state": "stable",
        "batching": {"max_batch_size": max_batch_size, "max_wait_ms": max_wait_ms},
    })
    assert response.status_code == 201, response.text
    response = admin.put(f"/v1/models/{name}/routing", json={"weights": {version: 100.0}, "reason": "test"})
    assert response.status_code == 200, response.text
    return name


# --- worker processes --------------------------------------------------------------------------------------


@dataclass
class WorkerProcess:
    model: str
    version: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self, tail: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-tail:]

    def terminate(self, *, timeout_s: float = 30.0) -> int:
        _stop_process(self.proc, signal.SIGTERM, timeout_s)
        return int(self.proc.returncode)


def worker_ready(rds: redis.Redis, worker: WorkerProcess) -> bool:
    for key in rds.scan_iter(match=keys.heartbeat_pattern(worker.model, worker.version), count=1000):
        beat = rds.hgetall(key)
        if beat.get("pid") == str(worker.proc.pid) and beat.get("state") == "ready":
            return True
    return False


def spawn_worker(*, redis_url: str, database_url: str, home: Path, log_path: Path, model: str,
                 version: str = "v1", env: dict[str, str] | None = None,
                 ready_timeout_s: float = 60.0) -> WorkerProcess:
    """Start `sluice worker` against the given stores; answer once its heartbeat says `ready`."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    environment.update({
        "SLUICE_REDIS_URL": redis_url, "SLUICE_DATABASE_URL": database_url, "SLUICE_HOME": str(home),
        "SLUICE_CLAIM_AFTER_S": "5", "SLUICE_SHUTDOWN_GRACE_S": "15", "PYTHONUNBUFFERED": "1",
        **(env or {}),
    })
    with log_path.open("ab") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sluice.cli", "worker", "--model", model, "--version", version, "--threads", "1"],
            cwd=REPO, env=environment, stdout=sink, stderr=subprocess.STDOUT,
        )
    worker = WorkerProcess(model=model, version=version, proc=proc, log_path=log_path)
    rds = redis.Redis.from_url(redis_url, decode_responses=True)
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
