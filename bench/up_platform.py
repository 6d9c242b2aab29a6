"""`sluice up` as a bench's subject: the whole platform (embedded stores, the API, the scheduler
with its local workers for the demo models, Celery, Flower) on a fresh home and free ports.

`running_up()` starts `python -m launch.cli up --no-demo` as a user would, waits for the line it
prints once every demo model has a warm worker, and answers where its parts are: the API's and
the embedded Valkey's process ids (read from /proc and the home's pid files, so a bench can read
their CPU) and a tenant of the bench's own, made through the admin API with limits no bench
reaches (the demo tenant's 200 submits a second would answer 429 mid-run). On the way out it
stops the launcher with SIGTERM, which stops everything it started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bench.processes import REPO, descendants, free_port

READY_LINE = "Ctrl-C stops everything."
ADMIN_KEY = "bench-admin-key-for-sluice-up-0123"


@dataclass(frozen=True, slots=True)
class RunningUp:
    home: Path
    port: int
    api_pid: int
    redis_pid: int
    redis_url: str
    tenant: str
    key: str
    launcher_pid: int

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def worker_pids(self) -> list[int]:
        """The model workers the scheduler started (`launch.cli worker`), alive now."""
        return [pid for pid in descendants(self.launcher_pid) if _cmdline(pid)[2:4] == ["launch.cli", "worker"]]


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _redis_url(output: str) -> str:
    """From the `Redis    redis://127.0.0.1:PORT/0` line `sluice up` prints."""
    line = next(line for line in output.splitlines() if line.strip().startswith("Redis "))
    return line.split()[-1]


def _bench_tenant(api_url: str, tenant: str) -> str:
    import httpx

    answer = httpx.post(
        f"{api_url}/v1/tenants",
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        json={"id": tenant, "rate_limit_per_s": 1e6, "max_queued": 10**9},
        timeout=30,
    )
    answer.raise_for_status()
    return str(answer.json()["key"]["secret"])


@contextlib.contextmanager
def running_up(*, checkout: Path = REPO, tenant: str = "bench", timeout_s: float = 300.0,
               grace_s: float = 10.0) -> Iterator[RunningUp]:
    """`sluice up --no-demo` from `checkout`'s code (its children inherit the `PYTHONPATH`) on a
    fresh home; see the module's docstring."""
    with tempfile.TemporaryDirectory(prefix="sluice-bench-up-") as tmp:
        home, output = Path(tmp) / "home", Path(tmp) / "up.out"
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
        env.update(
            SLUICE_HOME=str(home),
            SLUICE_API_PORT=str(port),
            SLUICE_FLOWER_PORT=str(free_port()),
            SLUICE_BOOTSTRAP_ADMIN_KEY=ADMIN_KEY,
            SLUICE_SHUTDOWN_GRACE_S=str(grace_s),
            PYTHONPATH=str(checkout),
            PYTHONUNBUFFERED="1",
        )
        with output.open("w") as sink:
            proc = subprocess.Popen(
                [sys.executable, "-m", "launch.cli", "up", "--no-demo"],
                env=env, cwd=tmp, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
            )
        try:
            deadline = time.monotonic() + timeout_s
            while READY_LINE not in output.read_text(errors="replace"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"sluice up not ready:\n{output.read_text(errors='replace')[-3000:]}")
                time.sleep(0.5)
            api = [pid for pid in descendants(proc.pid) if _cmdline(pid)[2:4] == ["launch.cli", "api"]]
            if len(api) != 1:
                raise RuntimeError(f"expected one API process under sluice up, found {api}")
            up = RunningUp(
                home=home,
                port=port,
                api_pid=api[0],
                redis_pid=int((home / "run" / "valkey.pid").read_text().split()[0]),
                redis_url=_redis_url(output.read_text(errors="replace")),
                tenant=tenant,
                key=_bench_tenant(f"http://127.0.0.1:{port}", tenant),
                launcher_pid=proc.pid,
            )
            yield up
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=grace_s + 60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
