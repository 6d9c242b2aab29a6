"""The README's first command: `sluice up` brings everything up on embedded stores and runs the demo."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.model]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_up_runs_the_demo_on_embedded_stores_and_stops_cleanly(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    flower_port = _free_port()
    env.update(SLUICE_HOME=str(tmp_path / "home"), SLUICE_API_PORT=str(_free_port()),
               SLUICE_FLOWER_PORT=str(flower_port), SLUICE_BOOTSTRAP_ADMIN_KEY="admin-key-for-the-up-test-0123")
    done = subprocess.run([sys.executable, "-m", "launch.cli", "up", "--exit-after-demo"], env=env,
                          capture_output=True, text=True, timeout=280, cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "Sluice is up" in output
    # Printed only once Flower answered its health check (Platform.wait_ready).
    assert f"Flower   http://127.0.0.1:{flower_port}" in output, output
    assert output.count("embedding dim=384") == 3, output
    for label in ("card_lost", "opening_hours", "reset_password"):
        assert f"label={label}" in output, output
    assert done.stdout.rstrip().endswith("stopped"), output
    # The stores kept their state under SLUICE_HOME, and nothing of ours still runs.
    assert (tmp_path / "home" / "postgres").is_dir()
    assert (tmp_path / "home" / "demo.key").read_text().startswith("sk_demo_")
    leftovers = subprocess.run(["pgrep", "-f", str(tmp_path / "home")], capture_output=True, text=True)
    assert leftovers.stdout.strip() == "", leftovers.stdout
    flower = subprocess.run(["pgrep", "-f", f"--port={flower_port}"], capture_output=True, text=True)
    assert flower.stdout.strip() == "", flower.stdout
