"""The API's two-stage shutdown, on a real `sluice api` process: the first SIGTERM drains (waits
end with the job's current state, requests in flight may finish), a second one exits at once."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from launch.seed import Seeded
from tests.support import REPO, wait_until


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow
def test_first_sigterm_drains_and_a_second_exits_at_once(
    redis_url: str, database_url: str, home: Path, tmp_path: Path, seeded: Seeded, demo: httpx.Client,
    register_synthetic: Callable[..., str],
) -> None:
    model = register_synthetic("drain")  # no worker: its jobs stay queued
    job_id = demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": "waiting"}}).json()["id"]
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    env.update({"SLUICE_REDIS_URL": redis_url, "SLUICE_DATABASE_URL": database_url, "SLUICE_HOME": str(home),
                "SLUICE_SHUTDOWN_GRACE_S": "60", "PYTHONUNBUFFERED": "1"})
    log_path = tmp_path / "api.log"
    with log_path.open("wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "launch.cli", "api", "--port", str(port)], cwd=REPO,
                                env=env, stdout=sink, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        def ready() -> bool:
            assert proc.poll() is None, log_path.read_text()
            try:
                return httpx.get(f"{base}/readyz", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(ready, timeout_s=60, what="the API to be ready")

        answers: dict[str, Any] = {}

        def long_poll() -> None:
            with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {seeded.demo_key}"}) as client:
                started = time.monotonic()
                response = client.get(f"/v1/jobs/{job_id}", params={"wait": 50}, timeout=70)
                answers.update(status=response.status_code, job=response.json(), after=time.monotonic() - started)

        poller = threading.Thread(target=long_poll)
        poller.start()
        # A request still uploading its body holds graceful shutdown open until the grace period.
        upload = socket.create_connection(("127.0.0.1", port))
        upload.sendall(f"POST /v1/models/{model}/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       f"Authorization: Bearer {seeded.demo_key}\r\nContent-Length: 100\r\n\r\n{{".encode())
        time.sleep(1.0)

        proc.send_signal(signal.SIGTERM)
        poller.join(timeout=10)
        assert not poller.is_alive(), "the long-poll did not end on drain"
        assert answers["status"] == 200 and answers["job"]["status"] == "queued"
        assert answers["after"] < 10
        time.sleep(1.0)
        assert proc.poll() is None, "graceful shutdown must wait for the request in flight"

        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
        assert time.monotonic() - signalled < 10
        upload.close()
        assert "second signal" in log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
