"""The real platform as subprocesses, against the system Redis and Postgres: a fresh database, a
dedicated Redis DB, the API and workers (`BenchPlatform`)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.processes import REPO, free_port, stop_processes


@dataclass(frozen=True, slots=True)
class ExtraVersion:
    """A second version of an existing model (same artifact) with its own batching."""

    model: str
    version: str
    artifact: str
    max_batch_size: int
    max_wait_ms: float


@dataclass
class BenchPlatform:
    """Fresh database + dedicated Redis DB index + API + workers; `close()` undoes all of it.

    Use as a context manager. Children run in their own sessions (Ctrl-C reaches only the
    bench, which then stops them in order) and log to `home/logs`.
    """

    pg_admin_url: str = "postgresql://postgres@127.0.0.1:5432/test"
    redis_base: str = "redis://127.0.0.1:6379"
    redis_db: int = 13
    extra_versions: Sequence[ExtraVersion] = ()
    # Seeded versions to run with other load options over the same bytes (``?quantize=int8``),
    # keyed "model/version": the artifact is swapped before the API or any worker reads it.
    seeded_artifacts: Mapping[str, str] = field(default_factory=dict)
    # Seeded versions' batching window (`max_wait_ms`), keyed likewise: a budget-tuned setting.
    seeded_max_wait_ms: Mapping[str, float] = field(default_factory=dict)
    keep_home: bool = False
    home: Path = field(init=False)
    db_name: str = field(init=False, default="")
    database_url: str = field(init=False, default="")
    redis_url: str = field(init=False, default="")
    api_port: int = field(init=False, default=0)
    demo_key: str = field(init=False, default="")
    admin_key: str = field(init=False, default="")
    api: subprocess.Popen[bytes] | None = field(init=False, default=None)
    workers: dict[str, list[subprocess.Popen[bytes]]] = field(init=False, default_factory=dict)
    _db_created: bool = field(init=False, default=False)

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def __enter__(self) -> BenchPlatform:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is not None and exc_type is not KeyboardInterrupt:
            # Keep the children's logs for a post-mortem.
            self.keep_home = True
            print(f"platform logs kept in {self.home / 'logs'}", file=sys.stderr)
        self.close()

    def _env(self) -> dict[str, str]:
        return dict(os.environ, SLUICE_REDIS_URL=self.redis_url, SLUICE_DATABASE_URL=self.database_url,
                    SLUICE_HOME=str(self.home), PYTHONUNBUFFERED="1")

    def _admin(self, sql: str) -> None:
        import sqlalchemy as sa

        engine = sa.create_engine(self.pg_admin_url.replace("postgresql://", "postgresql+psycopg://", 1),
                                  isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as conn:
                conn.execute(sa.text(sql))
        finally:
            engine.dispose()

    def redis(self) -> Any:
        import redis as redis_sync

        return redis_sync.Redis.from_url(self.redis_url)

    def start(self) -> None:
        from launch.seed import seed
        from sluice.artifacts import artifact_sha256, resolve_artifact
        from sluice.migrate import upgrade
        from sluice.registry import catalog
        from sluice.registry.store import Registry
        from sluice.registry.tables import ModelVersion

        self.home = Path(tempfile.mkdtemp(prefix="sluice-bench-"))
        self.db_name = f"sluice_bench_{os.urandom(4).hex()}"
        self._admin(f'CREATE DATABASE "{self.db_name}"')
        self._db_created = True
        self.database_url = self.pg_admin_url.rsplit("/", 1)[0] + "/" + self.db_name
        self.redis_url = f"{self.redis_base}/{self.redis_db}"
        client = self.redis()
        try:
            client.flushdb()
        finally:
            client.close()
        upgrade(self.database_url)
        registry = Registry(url=self.database_url, pool_size=1)
        try:
            seeded = seed(registry, home=self.home)
            self.demo_key, self.admin_key = seeded.demo_key, seeded.admin_key
            # Registered before the API starts, so its first routing snapshot already has them.
            with registry.session() as session:
                for key, artifact in self.seeded_artifacts.items():
                    model, version = key.split("/", 1)
                    row = catalog.get_version(session, model, version)
                    if artifact_sha256(resolve_artifact(artifact)) != row.sha256:
                        raise ValueError(f"{artifact!r} is not the bytes of {key} ({row.artifact!r})")
                    row.artifact = artifact
                for key, max_wait_ms in self.seeded_max_wait_ms.items():
                    catalog.get_version(session, *key.split("/", 1)).max_wait_ms = max_wait_ms
                for extra in self.extra_versions:
                    if session.get(ModelVersion, (extra.model, extra.version)) is None:
                        catalog.register_version(
                            session, model=extra.model, version=extra.version, artifact=extra.artifact,
                            sha256=artifact_sha256(resolve_artifact(extra.artifact)), actor="bench",
                            state="staged", max_batch_size=extra.max_batch_size, max_wait_ms=extra.max_wait_ms,
                        )
        finally:
            registry.dispose()
        self.api_port = free_port()
        self.api = self._spawn("api", ["api", "--port", str(self.api_port)])

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        logs = self.home / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with (logs / f"{name}.log").open("ab") as sink:
            return subprocess.Popen([sys.executable, "-m", "launch.cli", *args], env=self._env(), cwd=REPO,
                                    stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)

    def start_workers(self, model: str, version: str, n: int, threads: int = 1) -> list[subprocess.Popen[bytes]]:
        procs = [self._spawn(f"worker-{model}-{version}-{i}",
                             ["worker", "--model", model, "--version", version, "--threads", str(threads),
                              "--device", "cpu"])
                 for i in range(n)]
        self.workers.setdefault(f"{model}/{version}", []).extend(procs)
        return procs

    def wait_ready(self, model: str, version: str, n: int, timeout_s: float = 180.0) -> None:
        from sluice.wire import keys

        client = self.redis()
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                self.check_alive()
                ready = sum(1 for k in client.scan_iter(keys.heartbeat_pattern(model, version))
                            if client.hget(k, "state") == b"ready")
                if ready >= n and self._api_ready():
                    return
                time.sleep(0.25)
        finally:
            client.close()
        raise TimeoutError(f"{n} workers of {model}/{version} and the API were not ready in {timeout_s}s; "
                           f"see {self.home / 'logs'}")

    def _api_ready(self) -> bool:
        import httpx

        try:
            return httpx.get(f"{self.api_url}/readyz", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def check_alive(self) -> None:
        for name, procs in [("api", [self.api] if self.api else []), *self.workers.items()]:
            for proc in procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} (pid {proc.pid}) exited with {proc.returncode}; "
                                       f"see {self.home / 'logs'}")

    def pids(self) -> dict[str, int]:
        out = {"api": self.api.pid} if self.api else {}
        for name, procs in self.workers.items():
            for i, proc in enumerate(procs):
                if proc.poll() is None:
                    out[f"worker {name} #{i}"] = proc.pid
        return out

    def stop_workers(self, model: str, version: str) -> None:
        stop_processes(self.workers.pop(f"{model}/{version}", []))

    def close(self) -> None:
        # Every step runs even if an earlier one fails, and a second Ctrl-C cannot skip them.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            for name in list(self.workers):
                with contextlib.suppress(Exception):
                    stop_processes(self.workers.pop(name))
            if self.api is not None:
                with contextlib.suppress(Exception):
                    stop_processes([self.api])
                self.api = None
            if self.redis_url:
                with contextlib.suppress(Exception):
                    client = self.redis()
                    client.flushdb()
                    client.close()
            if self._db_created:
                with contextlib.suppress(Exception):
                    self._admin(f'DROP DATABASE IF EXISTS "{self.db_name}" WITH (FORCE)')
                    self._db_created = False
            if not self.keep_home and getattr(self, "home", None) is not None and self.home.exists():
                import shutil

                shutil.rmtree(self.home, ignore_errors=True)
        finally:
            signal.signal(signal.SIGINT, previous)
