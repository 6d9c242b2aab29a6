"""The watchdog of the embedded stores: a tiny separate process that stops the servers if the
process that started them dies without stopping them itself (a SIGKILL, a crash).

It inherits the home lock and holds it until it is done, so a restart right after a crash waits
for it instead of racing it. The parent's other children (API, scheduler, Celery) stop on their
own when it dies (`sluice.processes.die_with_parent`) and may need the stores to drain, so the
watchdog waits for them first (and SIGKILLs them at the grace), then stops the servers.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

WATCHDOG_GRACE_S = 25.0

# Runs as `python -I -c`: stdlib only, so it starts fast and cannot pick up a broken project.
# Reads "PID SIGNAL" lines to watch a server, "PID 0" to wait for a process that stops by itself,
# "-PID" to forget one and "exit" when the parent stops everything itself. EOF (or SIGTERM) means
# the parent is gone: wait for the self-stopping processes, then signal every server and wait;
# each stage SIGKILLs what is left at the grace.
_WATCHDOG_SOURCE = r"""
import os, signal, sys, time

grace = float(sys.argv[1])
parent = os.getppid()
procs = []

def alive(pid):
    if os.path.isdir("/proc/self"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except OSError:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True

def settle(pids):
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.1)
    for pid in pids:
        if alive(pid):
            print(f"{time.ctime()}: {pid} still running after {grace}s, killing it", flush=True)
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

def reap(*_):
    print(f"{time.ctime()}: parent {parent} gone, stopping {procs}", flush=True)
    settle([pid for pid, sig in procs if not sig])
    servers = [(pid, sig) for pid, sig in procs if sig]
    for pid, sig in servers:
        try:
            os.kill(pid, sig)
        except OSError:
            pass
    settle([pid for pid, _ in servers])
    os._exit(0)

signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, reap)
for line in sys.stdin:
    words = line.split()
    if words == ["exit"]:
        os._exit(0)
    if len(words) == 1:
        procs = [p for p in procs if p[0] != -int(words[0])]
    else:
        procs.append((int(words[0]), int(words[1])))
reap()
"""


class Watchdog:
    """A separate process that stops the servers if this one dies without calling stop()."""

    def __init__(self, *, log_path: Path, lock_fd: int, pid_file: Path, grace_s: float = WATCHDOG_GRACE_S) -> None:
        with log_path.open("ab") as log_file:
            self._process = subprocess.Popen(
                [sys.executable, "-I", "-c", _WATCHDOG_SOURCE, str(grace_s)],
                stdin=subprocess.PIPE,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                pass_fds=(lock_fd,),
                start_new_session=True,
                cwd="/",
            )
        pid_file.write_text(f"{self._process.pid}\n")
        self._pid_file = pid_file

    def _send(self, line: str) -> None:
        stdin = self._process.stdin
        # Closed by release(): the watchdog is gone and needs no more news.
        with contextlib.suppress(OSError, ValueError):
            if stdin is not None:
                stdin.write(f"{line}\n".encode())
                stdin.flush()

    def watch(self, pid: int, sig: int) -> None:
        self._send(f"{pid} {int(sig)}")

    def wait_for(self, pid: int) -> None:
        """Before stopping the servers, wait for `pid`, which stops by itself when the parent dies."""
        self._send(f"{pid} 0")

    def forget(self, pid: int) -> None:
        self._send(f"-{pid}")

    def release(self) -> None:
        """Let it exit without touching the servers: the caller stops them itself."""
        self._send("exit")
        with contextlib.suppress(OSError):
            if self._process.stdin is not None:
                self._process.stdin.close()
        try:
            self._process.wait(5.0)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._pid_file.unlink(missing_ok=True)
