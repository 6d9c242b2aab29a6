"""The processes and pid files a killed previous run of the embedded stores left behind.

A pid file alone proves nothing after a crash: the number may belong to an unrelated process by
now. Both servers chdir into their data directory, so a live pid whose working directory is that
directory is ours.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from pathlib import Path

log = logging.getLogger(__name__)

ORPHAN_STOP_S = 20.0


def alive(pid: int) -> bool:
    """True for a live, non-zombie process."""
    proc_stat = Path(f"/proc/{pid}/stat")
    if Path("/proc/self").is_dir():
        try:
            return proc_stat.read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except OSError:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def runs_in(pid: int, directory: Path) -> bool:
    """Whether `pid` is a live process whose working directory is `directory`.

    Both servers chdir into their data directory, so this tells one of ours from an unrelated
    process that happens to have reused the pid recorded by a previous run.
    """
    if not alive(pid):
        return False
    try:
        return os.readlink(f"/proc/{pid}/cwd") == str(directory.resolve())
    except OSError:
        return False


def kill_orphan(pid: int, sig: int, name: str) -> None:
    log.warning("stopping %s (pid %d) left running by a previous run", name, pid)
    for current, wait_s in ((sig, ORPHAN_STOP_S), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, current)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not alive(pid):
                return
            time.sleep(0.1)


def read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def stop_previous(pid_file: Path, data_dir: Path, sig: int, name: str) -> None:
    """Stop a server a killed previous run left behind, then drop its pid file."""
    pid = read_pid(pid_file)
    if pid is not None and pid != os.getpid() and runs_in(pid, data_dir):
        kill_orphan(pid, sig, name)
    pid_file.unlink(missing_ok=True)
