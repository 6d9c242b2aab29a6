"""`sluice up`: the whole platform on one machine, then a short demo.

Child processes run in their own sessions, so Ctrl-C reaches only this process, which then
stops them: Flower, the Celery workers (webhook delivery with beat; batches), the scheduler (its workers
drain) and the API all at once, each within one grace period, then the stores. Should this
process die without stopping them (SIGKILL), each child gets its own SIGTERM from the kernel
(`die_with_parent`) and the stores' watchdog stops the stores once the children are gone.
While it runs, `supervise()` restarts an embedded store that died.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import redis
import redis.asyncio as aioredis

from launch.api_client import ApiClient
from launch.embedded import EmbeddedStores, start_embedded
from launch.seed import DEMO_VERSIONS, Seeded, seed
from sluice import exposition
from sluice.errors import SluiceError
from sluice.migrate import upgrade
from sluice.processes import die_with_parent
from sluice.registry.store import Registry
from sluice.settings import Settings
from sluice.wire import heartbeats
from sluice.wire.connections import as_cluster_url, connect, connect_sync
from sluice.wire.heartbeats import WorkerState
from workers.tasks import BATCH_QUEUE, WEBHOOK_QUEUE

log = logging.getLogger(__name__)

# Flower keeps no state, and its exit waits on an event thread that retries a broker that is
# down for as long as it likes: it gets this long, not the drain's grace.
FLOWER_STOP_S = 3.0
# Past the children's own grace, for their interpreters to exit before they are killed.
STOP_SLACK_S = 2.0
# How often the Prometheus file-SD file is rewritten from the advertised endpoints.
TARGETS_EVERY_S = 2.0

# The alerting and SLO rules shipped with the checkout (deploy/prometheus/). Installed from a
# wheel there is no such folder: the glob matches nothing, which Prometheus accepts.
ALERT_RULES = Path(__file__).resolve().parent.parent / "deploy" / "prometheus" / "*.rules.yml"

# Scrapes whatever the targets file lists, re-read as `sluice up` rewrites it.
PROMETHEUS_CONFIG = """\
# Written by `sluice up`: prometheus --config.file=<this file>
global:
  scrape_interval: 5s
  evaluation_interval: 15s
rule_files:
  - {rules}
scrape_configs:
  - job_name: sluice
    file_sd_configs:
      - files: [{targets}]
        refresh_interval: 5s
"""

DEMO_TEXTS = (
    "I lost my credit card yesterday, please block it",
    "What time do you open on Saturdays?",
    "How do I reset my password?",
)


def celery_workers(settings: Settings) -> list[tuple[str, list[str]]]:
    """The Celery workers `sluice up` runs, a name and `celery` arguments each: one per queue
    (workers/tasks.py), so batch feeders never hold a thread webhook deliveries need. The threads
    pool: both wait on the network or the disk. Beat runs in the delivery worker."""
    common = ["--pool", "threads", "--without-mingle", "--without-gossip", "--loglevel", "INFO"]
    return [
        ("celery-webhooks", ["-A", "workers.tasks", "worker", "--beat", "--queues", WEBHOOK_QUEUE,
                             "--hostname", "sluice-webhooks@%h", "--concurrency", str(settings.webhook_concurrency),
                             *common]),
        # Its feeders, and a thread for the sweep.
        ("celery-batches", ["-A", "workers.tasks", "worker", "--queues", BATCH_QUEUE,
                            "--hostname", "sluice-batches@%h",
                            "--concurrency", str(settings.batch_feeders_per_worker + 1), *common]),
    ]


class Platform:
    def __init__(self, *, settings: Settings) -> None:
        self.settings = settings
        self.home = settings.home.resolve()
        # Where batch `input_uri`s and schedules may read and write (each tenant in its folder,
        # `tenants/<tenant>/`): SLUICE_BATCH_ROOT, else a folder of the home, so that a schedule
        # works out of the box.
        self.batch_root = (settings.batch_root or self.home / "batch-root").resolve()
        self.stores: EmbeddedStores | None = None
        self.children: list[tuple[str, subprocess.Popen[bytes]]] = []
        self._stop_within: dict[str, float] = {}
        self._targets_at = 0.0
        self._targets_client: redis.Redis | None = None

    @property
    def api_url(self) -> str:
        return f"http://{self.settings.api_host}:{self.settings.api_port}"

    @property
    def flower_url(self) -> str:
        return f"http://{self.settings.api_host}:{self.settings.flower_port}"

    @property
    def scrape_targets_path(self) -> Path:
        """Prometheus file-based service discovery of every process's metrics endpoint."""
        return self.home / "prometheus" / "targets.json"

    def _spawn(
        self,
        name: str,
        args: list[str],
        env: dict[str, str],
        *,
        module: str = "launch.cli",
        stop_within_s: float | None = None,
    ) -> None:
        log_dir = self.home / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        with (log_dir / f"{name}.log").open("ab") as sink:
            process = subprocess.Popen(
                [sys.executable, "-m", module, *args],
                env=env,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent(signal.SIGTERM),
            )
        self.children.append((name, process))
        if stop_within_s is not None:
            self._stop_within[name] = stop_within_s
        if self.stores is not None:
            self.stores.stop_after(process.pid)

    def _redis_url(self) -> str:
        """The stores' Redis as this process's own clients reach it (a cluster by setting, too)."""
        assert self.stores is not None
        url = self.stores.redis_url
        return as_cluster_url(url) if self.settings.redis_cluster else url

    def start(self) -> Seeded:
        self.home.mkdir(parents=True, exist_ok=True)
        # Should this process die, the watchdog gives the children the grace this stop gives them.
        self.stores = start_embedded(
            home=self.home,
            redis_url=self.settings.redis_url,
            database_url=self.settings.database_url,
            stop_grace_s=self.settings.shutdown_grace_s + STOP_SLACK_S,
        )
        self.batch_root.mkdir(parents=True, exist_ok=True)
        env = dict(
            os.environ,
            SLUICE_REDIS_URL=self.stores.redis_url,
            SLUICE_DATABASE_URL=self.stores.database_url,
            SLUICE_HOME=str(self.home),
            SLUICE_BATCH_ROOT=str(self.batch_root),
        )
        upgrade(self.stores.database_url)
        registry = Registry(url=self.stores.database_url, pool_size=1)
        try:
            admin = self.settings.bootstrap_admin_key
            seeded = seed(registry, home=self.home, bootstrap_admin_key=admin.get_secret_value() if admin else None)
        finally:
            registry.dispose()
        self._spawn("api", ["api"], env)
        self._spawn("scheduler", ["scheduler", "--actuator", "local"], env)
        for name, args in celery_workers(self.settings):
            self._spawn(name, args, env, module="celery")
        self._spawn(
            "flower",
            [
                "-A",
                "workers.tasks",
                "flower",
                f"--address={self.settings.api_host}",
                f"--port={self.settings.flower_port}",
            ],
            env,
            module="celery",
            stop_within_s=FLOWER_STOP_S,
        )
        return seeded

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Until the API is ready, Flower answers and every demo version has a warm worker."""
        assert self.stores is not None
        deadline = time.monotonic() + timeout_s
        # One loop and one client for the whole wait: the heartbeat readers are asyncio.
        with asyncio.Runner() as runner:
            client = connect(self._redis_url(), max_connections=2)
            try:
                while time.monotonic() < deadline:
                    self._check_children()
                    answering = self._answers(f"{self.api_url}/readyz") and self._answers(
                        f"{self.flower_url}/healthcheck"
                    )
                    if answering and runner.run(self._demo_workers_ready(client)):
                        return
                    time.sleep(0.5)
            finally:
                runner.run(client.aclose())
        raise TimeoutError(f"the platform was not ready within {timeout_s:.0f}s; see {self.home / 'logs'}")

    @staticmethod
    async def _demo_workers_ready(client: aioredis.Redis) -> bool:
        for demo in DEMO_VERSIONS:
            beats = await heartbeats.live_heartbeats(client, demo.model, demo.version, now=time.time())
            if not any(beat.state is WorkerState.ready for beat in beats):
                return False
        return True

    @staticmethod
    def _answers(url: str) -> bool:
        try:
            return httpx.get(url, timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def _check_children(self) -> None:
        for name, process in self.children:
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode}; see {self.home / 'logs' / name}.log")

    def supervise(self) -> None:
        """Restart an embedded store that died (on its data and port: the children reconnect), and
        keep the Prometheus targets file current."""
        if self.stores is not None:
            for name in self.stores.revive(time.monotonic()):
                log.warning("embedded %s restarted", name)
        if time.monotonic() - self._targets_at >= TARGETS_EVERY_S:
            self._targets_at = time.monotonic()
            try:
                self.write_scrape_targets()
            except SluiceError as exc:
                log.warning("could not refresh %s: %s", self.scrape_targets_path, exc)

    def write_prometheus_config(self) -> Path:
        """A Prometheus configuration over the file-SD file, with the alert rules, for
        `prometheus --config.file=…`."""
        path = self.home / "prometheus" / "prometheus.yml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(PROMETHEUS_CONFIG.format(targets=json.dumps(str(self.scrape_targets_path)),
                                                 rules=json.dumps(str(ALERT_RULES))))
        return path

    def write_scrape_targets(self) -> None:
        """The API and Flower at their fixed addresses; workers, the scheduler and the Celery worker
        where they advertise their ephemeral ports."""
        assert self.stores is not None
        if self._targets_client is None:
            self._targets_client = connect_sync(self._redis_url(), socket_timeout_s=2.0)
        host = self.settings.api_host
        fixed = [exposition.ScrapeTarget(address=f"{host}:{self.settings.api_port}", process="api"),
                 exposition.ScrapeTarget(address=f"{host}:{self.settings.flower_port}", process="flower")]
        advertised = exposition.live_targets(self._targets_client, now=time.time())
        exposition.write_file_sd(self.scrape_targets_path, [*fixed, *advertised])

    def stop(self) -> None:
        """Signal every child at once and give them one grace period together, then stop the stores.

        One shared deadline, not one per child in turn: with a store down each child may spend
        its whole grace failing to drain, and turn by turn that added up to minutes.
        """
        for _, process in reversed(self.children):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        grace_s = self.settings.shutdown_grace_s + STOP_SLACK_S
        for name, process in reversed(self.children):
            deadline = started + min(grace_s, self._stop_within.get(name, grace_s))
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in time; killing it", name)
                process.kill()
                process.wait()
            if self.stores is not None:
                self.stores.forget(process.pid)
        self.children.clear()
        if self._targets_client is not None:
            self._targets_client.close()
            self._targets_client = None
        if self.stores is not None:
            self.stores.stop()
            self.stores = None


def run_demo(api_url: str, demo_key: str) -> list[dict[str, Any]]:
    """Submit a few texts to both demo models and wait for the answers."""
    results = []
    with ApiClient(base_url=api_url, api_key=demo_key) as client:
        submitted = [("minilm", client.submit("minilm", {"text": t})) for t in DEMO_TEXTS]
        submitted += [("intent", client.submit("intent", {"text": t})) for t in DEMO_TEXTS]
        for model, job in submitted:
            results.append({"model": model, **client.wait(job["id"], timeout_s=60)})
    return results


def describe(result: dict[str, Any]) -> str:
    if result["status"] != "succeeded":
        return f"{result['status']}: {result.get('error')}"
    output = result["output"]
    if "embedding" in output:
        head = ", ".join(f"{x:+.3f}" for x in output["embedding"][:4])
        return f"embedding dim={output['dim']} [{head}, ...]"
    top = output["scores"][output["label"]]
    return f"label={output['label']} p={top:.2f}"


def _printable_home(home: Path) -> str:
    try:
        return str(home.relative_to(Path.cwd()))
    except ValueError:
        return str(home)
