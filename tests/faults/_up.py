"""`sluice up` as a new user runs it (embedded stores, demo models), in a process a test may kill.

Ready means the launcher printed "Ctrl-C stops everything.": the API answers, Flower answers and
each demo model has a warm worker. The process tree is read from /proc, so a test can check that
every process the launcher started, and their children, are gone.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.support import REPO

from ._support import free_port

ADMIN_KEY = "admin-key-for-the-up-faults-0123"
READY_LINE = "Ctrl-C stops everything."


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def children_of(pid: int) -> list[int]:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    found: list[int] = []
    for task in tasks:
        try:
            found += [int(p) for p in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        except OSError:
            continue
    return found


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for child in children_of(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@contextmanager
def holding(port: int, *, timeout_s: float = 2.0) -> Iterator[None]:
    """Keep `port` taken, so a server cannot bind it; a client that connects is closed on at once."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the dead server's TIME_WAITs
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock.bind(("127.0.0.1", port))
            break
        except OSError:
            assert time.monotonic() < deadline, f"port {port} still in use after {timeout_s}s"
            time.sleep(0.005)
    sock.listen(64)
    sock.settimeout(0.2)
    done = threading.Event()

    def refuse() -> None:
        while not done.is_set():
            try:
                sock.accept()[0].close()
            except TimeoutError:
                continue

    thread = threading.Thread(target=refuse, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        sock.close()


def wait_gone(pids: list[int], ports: list[int], *, timeout_s: float) -> float:
    """Seconds until no pid is alive and every port can be bound; fails the test past timeout_s."""
    started = time.monotonic()
    while True:
        left = [p for p in pids if alive(p)]
        busy = [p for p in ports if not bindable(p)]
        if not left and not busy:
            return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"after {timeout_s}s still running: {left}, ports still held: {busy}")
        time.sleep(0.1)


@dataclass
class Up:
    home: Path
    api_port: int
    flower_port: int
    grace_s: float
    proc: subprocess.Popen[str]
    output: Path
    tree: tuple[int, ...] = ()

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def text(self) -> str:
        return self.output.read_text(errors="replace")

    def demo_key(self) -> str:
        return (self.home / "demo.key").read_text().strip()

    def valkey_port(self) -> int:
        """From the `Redis    redis://127.0.0.1:PORT/0` line `sluice up` prints."""
        line = next(line for line in self.text().splitlines() if line.strip().startswith("Redis "))
        return int(line.rsplit(":", 1)[1].split("/")[0])

    def server_pid(self, name: str) -> int:
        return int((self.home / "run" / f"{name}.pid").read_text().split()[0])

    def store_ports(self) -> list[int]:
        """The ports the embedded stores listen on (the sockets their processes hold)."""
        inodes = set()
        for pid in (self.server_pid("valkey"), self.server_pid("postgres")):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:[") : -1])
        ports = set()
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                ports.add(int(fields[1].split(":")[1], 16))
        assert len(ports) == 2, ports
        return sorted(ports)

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while READY_LINE not in self.text():
            assert self.proc.poll() is None, f"sluice up exited with {self.proc.returncode}:\n{self.text()}"
            assert time.monotonic() < deadline, f"sluice up not ready after {timeout_s}s:\n{self.text()}"
            time.sleep(0.2)

    def terminate(self) -> None:
        """SIGTERM (an orderly stop); SIGKILL what is left of the tree, as it was when ready, too."""
        tree = set(self.tree) | set(descendants(self.proc.pid))
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.grace_s + 30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in tree:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def start_up(tmp_path: Path, *, grace_s: float = 10.0, env_extra: dict[str, str] | None = None) -> Up:
    """Start `sluice up --no-demo` on a fresh home and free ports, with `env_extra` in its
    environment; answer once it is ready."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    home, api_port, flower_port, output = tmp_path / "home", free_port(), free_port(), tmp_path / "up.out"
    env.update(
        SLUICE_HOME=str(home),
        SLUICE_API_PORT=str(api_port),
        SLUICE_FLOWER_PORT=str(flower_port),
        SLUICE_BOOTSTRAP_ADMIN_KEY=ADMIN_KEY,
        SLUICE_SHUTDOWN_GRACE_S=str(grace_s),
        PYTHONPATH=str(REPO),
        PYTHONUNBUFFERED="1",
        **(env_extra or {}),
    )
    with output.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "launch.cli", "up", "--no-demo"],
            env=env,
            cwd=tmp_path,
            stdout=sink,
            stderr=subprocess.STDOUT,
            text=True,
        )
    up = Up(home=home, api_port=api_port, flower_port=flower_port, grace_s=grace_s, proc=proc, output=output)
    try:
        up.wait_ready()
        up.tree = tuple(descendants(proc.pid))
    except BaseException:
        up.terminate()
        raise
    return up
