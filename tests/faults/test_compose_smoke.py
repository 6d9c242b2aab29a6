"""compose.yaml works as documented, without a container engine: each of its Sluice services runs
natively, with its own command and environment as Compose resolves them (`docker-compose config`),
in dependency order, against a Redis and a Postgres of this test's own, until a job submitted
through the API succeeds and a version registered over REST gets workers of its own.

What differs from the containers, and why: hostnames and ports (`redis`, `postgres`, the published
ports) are this machine's; the Celery worker's fixed metrics port becomes 0, because natively its
processes share one network namespace; paths in volumes become folders of the test; the worker
pool gets four slots, as the README advises for a machine of fewer than four cores.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.support import REPO, fresh_database, wait_job, wait_until

from ._support import RedisServer

pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.soak]

SECRETS = {"GRAFANA_ADMIN_PASSWORD": "a-grafana-password", "SLUICE_ADMIN_KEY": "an-admin-key-of-the-smoke-0123",
           "FLOWER_PASSWORD": "a-flower-password"}
BIN = Path(sys.executable).parent
# Services that are images of other projects: the test brings its own Redis and Postgres, and
# Prometheus and Grafana are checked elsewhere (tests/unit/test_grafana_dashboard.py).
NOT_OURS = {"redis", "postgres", "prometheus", "grafana"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _resolved() -> dict[str, Any]:
    compose = shutil.which("docker-compose")
    assert compose, "this test reads compose.yaml with Compose itself: apt-get install -y docker-compose"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")} | SECRETS
    done = subprocess.run([compose, "-f", str(REPO / "compose.yaml"), "config"], env=env, capture_output=True,
                          text=True, timeout=60, cwd=REPO, check=True)
    return dict(yaml.safe_load(done.stdout)["services"])


def _order(services: dict[str, Any]) -> list[str]:
    """Ours in dependency order (depends_on), as Compose starts them."""
    ordered: list[str] = []

    def visit(name: str) -> None:
        if name in ordered or name in NOT_OURS:
            return
        for needed in services[name].get("depends_on") or {}:
            visit(needed)
        ordered.append(name)

    for name in sorted(services):
        visit(name)
    return ordered


class Stack:
    """The services of compose.yaml, run here."""

    def __init__(self, services: dict[str, Any], *, redis_url: str, database_url: str, root: Path) -> None:
        self.services = services
        self.redis_url, self.database_url, self.root = redis_url, database_url, root
        self.ports = {name: _free_port() for name in ("api", "flower")}
        self.running: dict[str, subprocess.Popen[bytes]] = {}

    def environment(self, name: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
        for key, value in (self.services[name].get("environment") or {}).items():
            env[key] = str(value)
        env.update(SLUICE_REDIS_URL=self.redis_url, SLUICE_DATABASE_URL=self.database_url,
                   SLUICE_HOME=str(self.root / name), SLUICE_BATCH_DIR=str(self.root / "batches"),
                   SLUICE_BATCH_ROOT=str(self.root / "data"), PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1",
                   PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
        if env.get("SLUICE_METRICS_PORT") not in (None, "0"):
            env["SLUICE_METRICS_PORT"] = "0"
        if name == "worker-pool":
            env["SLUICE_WORKER_SLOTS"] = "4"
        return env

    def command(self, name: str) -> list[str]:
        command = [str(part) for part in self.services[name]["command"]]
        command[0] = str(BIN / command[0])
        if name == "api":
            command[command.index("--port") + 1] = str(self.ports["api"])
            command[command.index("--host") + 1] = "127.0.0.1"
        if name == "flower":
            command = [re.sub(r"^--port=\d+$", f"--port={self.ports['flower']}", part) for part in command]
            command = [part.replace("--address=0.0.0.0", "--address=127.0.0.1") for part in command]
        return command

    def log(self, name: str) -> Path:
        return self.root / f"{name}.log"

    def run_to_completion(self, name: str) -> str:
        done = subprocess.run(self.command(name), env=self.environment(name), cwd=self.root, capture_output=True,
                              text=True, timeout=240)
        assert done.returncode == 0, (name, done.stdout, done.stderr)
        return done.stdout

    def start(self, name: str) -> None:
        with self.log(name).open("wb") as sink:
            self.running[name] = subprocess.Popen(self.command(name), env=self.environment(name), cwd=self.root,
                                                  stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self) -> None:
        for proc in self.running.values():
            if proc.poll() is None:
                os.killpg(proc.pid, 15)
        for proc in self.running.values():
            try:
                proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait(timeout=10)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    (tmp_path / "redis").mkdir()
    redis_server = RedisServer(directory=tmp_path / "redis")
    redis_server.start()
    try:
        with fresh_database("sluice_compose_", revision=None) as database_url:
            (tmp_path / "data").mkdir()
            stack = Stack(_resolved(), redis_url=redis_server.url, database_url=database_url, root=tmp_path)
            try:
                yield stack
            finally:
                stack.stop()
    finally:
        redis_server.stop()


def test_compose_services_run_in_order_until_jobs_succeed_and_a_registered_version_gets_workers(
    stack: Stack,
) -> None:
    order = _order(stack.services)
    assert order[:2] == ["migrate", "seed"], order
    assert set(order) == {"migrate", "seed", "api", "worker-pool", "celery-webhooks", "celery-batches", "flower"}, order
    stack.run_to_completion("migrate")
    demo_key = re.search(r"demo key: (\S+)", stack.run_to_completion("seed"))
    assert demo_key, "the seed prints the demo key (`docker compose logs seed`)"
    for name in order[2:]:
        stack.start(name)
    api = f"http://127.0.0.1:{stack.ports['api']}"
    admin = {"Authorization": f"Bearer {SECRETS['SLUICE_ADMIN_KEY']}"}
    wait_until(lambda: _answers(f"{api}/readyz"), timeout_s=60, what="the API's readiness", interval_s=0.5)
    with httpx.Client(base_url=api, headers={"Authorization": f"Bearer {demo_key.group(1)}"}, timeout=30) as demo:
        submitted = demo.post("/v1/models/intent/jobs", json={"input": {"text": "I lost my card"}})
        assert submitted.status_code == 202, submitted.text
        job = wait_job(demo, submitted.json()["id"], timeout_s=120)
        assert job["status"] == "succeeded" and job["output"]["label"] == "card_lost", job

        # Registering a version and giving it weight is enough: the pool starts its worker.
        with httpx.Client(base_url=api, headers=admin, timeout=30) as operator:
            assert operator.post("/v1/models", json={"name": "echo", "kind": "synthetic"}).status_code == 201
            registered = operator.post("/v1/models/echo/versions", json={
                "version": "v1", "artifact": "synthetic:?fixed_s=0.001", "sha256": "0" * 64, "state": "stable"})
            assert registered.status_code == 201, registered.text
            assert operator.put("/v1/models/echo/routing", json={"weights": {"v1": 100}}).status_code == 200
        submitted = demo.post("/v1/models/echo/jobs", json={"input": {"text": "hello"}})
        assert submitted.status_code == 202, submitted.text
        assert wait_job(demo, submitted.json()["id"], timeout_s=120)["status"] == "succeeded"

    # Prometheus finds every process through the API (docker/prometheus.yml's HTTP discovery).
    def discovered() -> set[str]:
        return {group["labels"]["process"] for group in httpx.get(f"{api}/metrics/targets", timeout=5).json()}

    wait_until(lambda: {"worker", "scheduler", "celery"} <= discovered(), timeout_s=30,
               what="every process advertised", interval_s=0.5)
    flower = f"http://127.0.0.1:{stack.ports['flower']}"
    wait_until(lambda: _answers(f"{flower}/healthcheck"), timeout_s=60, what="Flower", interval_s=0.5)
    assert httpx.get(flower, timeout=5).status_code == 401
    assert httpx.get(flower, auth=("admin", SECRETS["FLOWER_PASSWORD"]), timeout=5).status_code == 200
    for name, proc in stack.running.items():
        assert proc.poll() is None, (name, stack.log(name).read_text()[-3000:])
