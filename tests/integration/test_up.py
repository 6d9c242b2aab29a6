"""The README's first command: `sluice up` brings everything up on embedded stores and runs the demo."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from sluice_client import SluiceClient
from tests.faults._up import start_up
from tests.support import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.model]

DASHBOARD = Path(__file__).resolve().parents[2] / "docker" / "grafana" / "dashboards" / "sluice.json"


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


def _dashboard_queries() -> list[str]:
    """Every PromQL expression of the Grafana dashboard, its variables set as "All" would set them."""
    found: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                found.append(node["expr"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json.loads(DASHBOARD.read_text()))
    values = {"$__rate_interval": "30s", "$__range": "5m", "$model": ".+", "$version": ".+", "$lane": ".+"}
    return [re.sub(r"\$__rate_interval|\$__range|\$model|\$version|\$lane", lambda m: values[m.group()], e)
            for e in found]


@pytest.mark.soak  # half a minute of real scrapes
def test_every_process_of_up_is_scraped_by_a_real_prometheus_and_the_dashboard_queries_answer(
    tmp_path: Path,
) -> None:
    """Metrics leave their processes: a real Prometheus, given the configuration `sluice up` writes,
    scrapes every endpoint of its file-SD file, and each query of the Grafana dashboard parses
    and evaluates there; the latency panels have data for both demo models."""
    prometheus = shutil.which("prometheus")
    assert prometheus, "this test runs a real Prometheus: apt-get install -y prometheus"
    up = start_up(tmp_path)
    server = None
    try:
        with SluiceClient(base_url=up.api_url, api_key=up.demo_key()) as client:
            jobs = [client.submit(model, {"text": f"How do I reset my password? {i}"})
                    for model in ("minilm", "intent") for i in range(5)]
            assert {client.wait(job["id"], timeout_s=60)["status"] for job in jobs} == {"succeeded"}
        port = _free_port()
        with (tmp_path / "prometheus.log").open("wb") as sink:
            server = subprocess.Popen(
                [prometheus, f"--config.file={up.home / 'prometheus' / 'prometheus.yml'}",
                 f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                stdout=sink, stderr=subprocess.STDOUT)
        api = f"http://127.0.0.1:{port}/api/v1"

        def healthy() -> dict[str, int]:
            try:
                targets = httpx.get(f"{api}/targets", timeout=2).json()["data"]["activeTargets"]
            except (httpx.HTTPError, ValueError, KeyError):
                return {}
            up_by_process: dict[str, int] = {}
            for target in targets:
                if target["health"] == "up":
                    process = target["labels"]["process"]
                    up_by_process[process] = up_by_process.get(process, 0) + 1
            return up_by_process

        def every_process_scraped() -> bool:
            seen = healthy()
            # The demo's two versions share one worker process on the 2-core default: one target.
            return {"api", "flower", "scheduler", "celery"} <= set(seen) and seen.get("worker", 0) >= 1

        wait_until(every_process_scraped, timeout_s=60, what="Prometheus scraping every process",
                   interval_s=0.5)
        def answers(query: str) -> list[dict[str, object]]:
            body = httpx.get(f"{api}/query", params={"query": query}, timeout=10).json()
            assert body["status"] == "success", (query, body)
            return list(body["data"]["result"])

        # rate() needs two scrapes after the batches: wait for both models' series.
        def models_with_two_scrapes() -> set[str]:
            return {str(r["metric"]["model"])
                    for r in answers("sum by (model) (rate(sluice_batch_size_count[30s]))")}

        wait_until(lambda: {"minilm", "intent"} <= models_with_two_scrapes(),
                   timeout_s=30, what="two scrapes of each model's workers", interval_s=1.0)
        queries = _dashboard_queries()
        assert len(queries) >= 20
        results = {query: answers(query) for query in queries}
        latency = [q for q in queries if "sluice_queue_wait_seconds_bucket" in q or "sluice_model_seconds_bucket" in q]
        assert latency
        for query in latency:
            models = {str(r["metric"]["model"]) for r in results[query]}
            assert {"minilm", "intent"} <= models, (query, results[query])
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=10)
        up.terminate()
