"""The two-stage shutdown helper (sluice/shutdown.py), with real signals sent to a real process in
both forms: `signal.signal` and the asyncio loop's handlers."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests.support import REPO

FORCED = 7  # what the test's `force` exits with, so a forced exit tells itself from any other

# Argument 1: "drains" (stop finishes the work, the process ends by itself) or "hangs" (stop
# starts a drain that never ends, so only a second signal ends the process).
PLAIN = """
import sys, threading
from sluice.shutdown import install_two_stage

done = threading.Event()
def stop():
    print("stopping", flush=True)
    if sys.argv[1] == "drains":
        done.set()
install_two_stage(stop, force=lambda: sys.exit(FORCED))
print("ready", flush=True)
done.wait()
print("drained", flush=True)
"""

LOOP = """
import asyncio, os, sys
from sluice.shutdown import install_two_stage

async def main():
    done = asyncio.Event()
    def stop():
        print("stopping", flush=True)
        if sys.argv[1] == "drains":
            done.set()
    install_two_stage(stop, force=lambda: os._exit(FORCED), loop=asyncio.get_running_loop())
    print("ready", flush=True)
    await done.wait()
    print("drained", flush=True)

asyncio.run(main())
"""


@contextmanager
def running(form: str, behaviour: str) -> Iterator[subprocess.Popen[str]]:
    source = (PLAIN if form == "plain" else LOOP).replace("FORCED", str(FORCED))
    with subprocess.Popen([sys.executable, "-c", source, behaviour], cwd=REPO, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        try:
            assert next_line(proc) == "ready"
            yield proc
        finally:
            proc.kill()


def next_line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    return proc.stdout.readline().strip()


@pytest.mark.parametrize("form", ["plain", "loop"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_the_first_signal_calls_stop_and_the_process_ends_cleanly(form: str, sig: signal.Signals) -> None:
    with running(form, "drains") as proc:
        proc.send_signal(sig)
        assert next_line(proc) == "stopping"
        assert next_line(proc) == "drained"
        assert proc.wait(timeout=10) == 0


@pytest.mark.parametrize("form", ["plain", "loop"])
def test_a_second_signal_of_either_kind_forces_the_exit(form: str) -> None:
    with running(form, "hangs") as proc:
        proc.send_signal(signal.SIGTERM)
        assert next_line(proc) == "stopping"
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.5)  # the drain goes on: the first signal alone does not end it
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == FORCED
        assert proc.stdout is not None and "stopping" not in proc.stdout.read()  # stop ran once
