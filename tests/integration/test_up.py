"""The README's first command: `sluice up` brings everything up on embedded stores and runs the demo."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sluice.client import SluiceClient
from tests.faults._up import start_up
from tests.support import wait_until

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


def test_every_process_of_up_serves_its_metrics_where_the_file_sd_file_says(tmp_path: Path) -> None:
    """Metrics leave their processes: each endpoint in the Prometheus file-SD file `sluice up`
    writes answers, and the workers' own histograms count the jobs they ran."""
    up = start_up(tmp_path)
    try:
        with SluiceClient(base_url=up.api_url, api_key=up.demo_key()) as client:
            jobs = [client.submit(model, {"text": "How do I reset my password?"}) for model in ("minilm", "intent")]
            assert {client.wait(job["id"], timeout_s=60)["status"] for job in jobs} == {"succeeded"}
        path = up.home / "prometheus" / "targets.json"

        def listed() -> dict[str, list[str]]:
            by_process: dict[str, list[str]] = {}
            for group in json.loads(path.read_text()) if path.exists() else []:
                by_process.setdefault(group["labels"]["process"], []).extend(group["targets"])
            return by_process

        wait_until(lambda: {"api", "flower", "scheduler", "celery", "worker"} <= set(listed())
                   and len(listed()["worker"]) >= 2, timeout_s=30, what=f"every process in {path}")
        scraped = {process: [httpx.get(f"http://{address}/metrics", timeout=5).text for address in addresses]
                   for process, addresses in listed().items()}
        assert all("sluice_api_requests_total" in text for text in scraped["api"])
        assert all("sluice_desired_replicas" in text for text in scraped["scheduler"])
        assert all("sluice_webhook_attempts_total" in text for text in scraped["celery"])
        assert all("flower_" in text for text in scraped["flower"])
        for model in ("minilm", "intent"):
            served = [text for text in scraped["worker"] if f'sluice_worker_ready{{model="{model}"' in text]
            assert served, f"no advertised worker serves {model}"
            finished = sum(sample.value for text in served for family in text_string_to_metric_families(text)
                           for sample in family.samples
                           if sample.name == "sluice_jobs_finished_total" and sample.labels["model"] == model)
            assert finished >= 1, model
    finally:
        up.terminate()
