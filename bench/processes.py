"""Child processes of a benchmark: free ports, a drained stop, `sluice api` on a port of its own,
SIGTERM as Ctrl-C, and a private redis-server."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_processes(procs: Sequence[subprocess.Popen[bytes]], grace_s: float = 40.0) -> None:
    """SIGTERM each (so it drains), then SIGKILL whatever is left when the shared grace runs out."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()


@contextlib.contextmanager
def sluice_api(*, env: dict[str, str], log: Path, timeout_s: float = 60.0) -> Iterator[tuple[int, int]]:
    """`sluice api` on a free port with `env` over the environment: answers (pid, port) once
    /readyz says 200, and stops it (`stop_processes`) on the way out."""
    import httpx

    port = free_port()
    with log.open("ab") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "launch.cli", "api", "--port", str(port)],
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **env}, cwd=REPO,
                                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the API did not start; see {log}")
            time.sleep(0.2)
        yield proc.pid, port
    finally:
        stop_processes([proc])


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Let SIGTERM unwind like Ctrl-C, so `finally` blocks clean up."""

    def handler(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def private_redis() -> Iterator[tuple[str, int]]:
    """A redis-server of the bench's own (no persistence): nobody else publishes on its channels."""
    import redis

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="sluice-bench-redis-") as directory:
        proc = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind", "127.0.0.1",
             "--dir", directory, "--save", "", "--appendonly", "no", "--daemonize", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            client = redis.Redis(port=port, socket_connect_timeout=0.5)
            deadline = time.monotonic() + 20
            while True:
                with contextlib.suppress(redis.RedisError):
                    if client.ping():
                        break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {port} did not start")
                time.sleep(0.05)
            client.close()
            yield f"redis://127.0.0.1:{port}", 0
        finally:
            proc.terminate()
            proc.wait(timeout=20)


def descendants(pid: int) -> list[int]:
    """Every descendant of `pid` (/proc/<pid>/task/*/children), depth first."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            for child in (task / "children").read_text().split():
                out += [int(child), *descendants(int(child))]
    return out
