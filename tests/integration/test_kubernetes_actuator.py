"""The kubernetes actuator against a local HTTP server that answers Deployments as the API server
does, through the official client: the group Deployments it makes from the template, what it
deletes, and what a failing or unreachable server becomes. No cluster is needed."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from kubernetes import client
from kubernetes.config import kube_config
from prometheus_client import REGISTRY
from typer.testing import CliRunner

from launch.cli import app
from scheduler.kubernetes import DEFAULT_TEMPLATE, GROUP_LABEL, MANAGED_SELECTOR, KubernetesActuator
from sluice.registry import catalog
from sluice.registry.store import Registry
from sluice.wire import keys, placements
from sluice.wire.placements import Group, PlacedVersion, PlacementPlan
from tests.support import SYNTHETIC_SHA, unique

NS = "sluice"
ONE = re.compile(r"/apis/apps/v1/namespaces/(?P<ns>[^/?]+)/deployments/(?P<name>[^/?]+)")
ALL = re.compile(r"/apis/apps/v1/namespaces/(?P<ns>[^/?]+)/deployments")
TEMPLATE = yaml.safe_load((Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "base"
                           / "workers.yaml").read_text().split("---", 1)[1])


@dataclass
class FakeApiServer:
    """Deployments by name (their JSON); `failing` names answer 500 to anything, and so does the
    list while `list_fails`."""

    url: str = ""
    deployments: dict[str, dict[str, Any]] = field(default_factory=dict)
    failing: set[str] = field(default_factory=set)
    list_fails: bool = False
    requests: list[dict[str, Any]] = field(default_factory=list)

    def listing(self, selector: str) -> dict[str, Any]:
        wanted = dict(part.split("=", 1) for part in selector.split(",") if part)
        items = [d for d in self.deployments.values() if wanted.items() <= d["metadata"].get("labels", {}).items()]
        return {"kind": "DeploymentList", "apiVersion": "apps/v1", "metadata": {}, "items": items}

    def calls(self, method: str) -> list[str]:
        return [r["name"] for r in self.requests if r["method"] == method and r["name"]]


def _status(code: int, reason: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "code": code, "reason": reason, "message": reason}


def _handler(server: FakeApiServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _answer(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            path, _, query = self.path.partition("?")
            one, every = ONE.fullmatch(path), ALL.fullmatch(path)
            name = one["name"] if one else (body or {}).get("metadata", {}).get("name", "")
            server.requests.append({"method": self.command, "name": name, "body": body})
            if name in server.failing or (every and self.command == "GET" and server.list_fails):
                self._answer(500, _status(500, "InternalError"))
            elif every and self.command == "GET":
                selector = dict(p.split("=", 1) for p in query.split("&") if "=" in p).get("labelSelector", "")
                self._answer(200, server.listing(selector.replace("%3D", "=").replace("%2C", ",").replace("%2F", "/")))
            elif every and self.command == "POST":
                if name in server.deployments:
                    self._answer(409, _status(409, "AlreadyExists"))
                else:
                    server.deployments[name] = body
                    self._answer(201, body)
            elif one and name not in server.deployments:
                self._answer(404, _status(404, "NotFound"))
            elif one and self.command == "DELETE":
                del server.deployments[name]
                self._answer(200, _status(200, "Success"))
            elif one:
                self._answer(200, server.deployments[name])
            else:
                self._answer(400, _status(400, "BadRequest"))

        do_GET = do_POST = do_DELETE = _serve

    return Handler


@pytest.fixture
def api_server() -> Iterator[FakeApiServer]:
    fake = FakeApiServer(deployments={DEFAULT_TEMPLATE: TEMPLATE})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
    fake.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield fake
    httpd.shutdown()
    httpd.server_close()
    thread.join()


def _apps(host: str) -> Any:
    configuration = client.Configuration(host=host)
    configuration.retries = 0  # a refused connection fails at once rather than after urllib3's retries
    return client.AppsV1Api(client.ApiClient(configuration))


@pytest.fixture
def actuator(api_server: FakeApiServer) -> KubernetesActuator:
    return KubernetesActuator(apps=_apps(api_server.url), namespace=NS)


def plan(*groups: str, threads: int = 1) -> PlacementPlan:
    return PlacementPlan(at=0.0, groups={g: Group(tier="latency", threads=threads, versions=(
        PlacedVersion(model="minilm", version="v1", config=""),)) for g in groups})


def _errors(operation: str) -> float:
    return REGISTRY.get_sample_value("sluice_actuator_errors_total", {"operation": operation}) or 0.0


def test_each_group_gets_a_copy_of_the_template_with_one_replica(
        api_server: FakeApiServer, actuator: KubernetesActuator) -> None:
    actuator.apply(plan("g1", "g2", threads=2))
    assert sorted(api_server.calls("POST")) == ["sluice-worker-g1", "sluice-worker-g2"]
    made = api_server.deployments["sluice-worker-g2"]
    assert made["spec"]["replicas"] == 1
    assert made["metadata"]["labels"][GROUP_LABEL] == "g2"
    assert made["spec"]["selector"]["matchLabels"][GROUP_LABEL] == "g2"
    env = {e["name"]: e["value"] for e in made["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["SLUICE_WORKER_GROUP"] == "g2" and env["SLUICE_WORKER_THREADS"] == "2"
    assert api_server.deployments[DEFAULT_TEMPLATE] == TEMPLATE, "the template is never changed"
    api_server.requests.clear()
    actuator.apply(plan("g1", "g2", threads=2))
    assert not api_server.calls("POST") and not api_server.calls("DELETE"), "the same plan changes nothing"


def test_a_group_that_leaves_the_plan_has_its_deployment_deleted(
        api_server: FakeApiServer, actuator: KubernetesActuator) -> None:
    actuator.apply(plan("g1", "g2"))
    actuator.apply(plan("g2", "g3"))
    assert api_server.calls("DELETE") == ["sluice-worker-g1"]
    assert sorted(api_server.deployments) == [DEFAULT_TEMPLATE, "sluice-worker-g2", "sluice-worker-g3"]


def test_on_start_the_deployments_of_groups_no_longer_planned_are_deleted(
        api_server: FakeApiServer, actuator: KubernetesActuator) -> None:
    earlier = KubernetesActuator(apps=_apps(api_server.url), namespace=NS)
    earlier.apply(plan("g4", "g5"))
    actuator.apply(plan("g5"))  # a restarted scheduler whose plan no longer has g4
    assert sorted(api_server.deployments) == [DEFAULT_TEMPLATE, "sluice-worker-g5"]
    assert api_server.calls("POST").count("sluice-worker-g5") == 1, "found by the listing: not made again"


def test_a_failing_group_is_counted_and_the_others_are_still_made_then_it_is_tried_again(
        api_server: FakeApiServer, actuator: KubernetesActuator) -> None:
    api_server.failing.add("sluice-worker-g1")
    before = _errors("create")
    actuator.apply(plan("g1", "g2"))
    assert "sluice-worker-g2" in api_server.deployments and _errors("create") == before + 1
    api_server.failing.clear()
    actuator.apply(plan("g1", "g2"))
    assert "sluice-worker-g1" in api_server.deployments


def test_a_failed_listing_deletes_nothing_until_a_listing_succeeds(
        api_server: FakeApiServer, actuator: KubernetesActuator) -> None:
    KubernetesActuator(apps=_apps(api_server.url), namespace=NS).apply(plan("g8"))
    api_server.list_fails = True
    before = _errors("list")
    actuator.apply(plan("g9"))
    assert _errors("list") == before + 1 and "sluice-worker-g8" in api_server.deployments
    api_server.list_fails = False
    actuator.apply(plan("g9"))
    assert "sluice-worker-g8" not in api_server.deployments
    assert any(r["method"] == "GET" and not r["name"] for r in api_server.requests)
    assert MANAGED_SELECTOR.startswith("app.kubernetes.io/component=worker")


def test_a_deployment_deleted_by_hand_is_made_again_at_the_next_listing(api_server: FakeApiServer) -> None:
    now = [0.0]
    actuator = KubernetesActuator(apps=_apps(api_server.url), namespace=NS, clock=lambda: now[0])
    actuator.apply(plan("g1"))
    del api_server.deployments["sluice-worker-g1"]
    actuator.apply(plan("g1"))
    assert "sluice-worker-g1" not in api_server.deployments, "not listed again within the minute"
    now[0] += 61
    actuator.apply(plan("g1"))
    assert "sluice-worker-g1" in api_server.deployments


def test_no_connection_is_counted_and_apply_never_raises() -> None:
    actuator = KubernetesActuator(apps=_apps("http://127.0.0.1:9"), namespace=NS)
    before = _errors("list") + _errors("read")
    actuator.apply(plan("g1"))
    assert _errors("list") + _errors("read") >= before + 2


def register_versions(registry: Registry, count: int) -> list[str]:
    """Models of one stable synthetic version (v1) each, at least one replica."""
    models = [unique("k8s") for _ in range(count)]
    with registry.session() as session:
        for model in models:
            catalog.create_model(session, name=model, kind="synthetic", actor="test")
            catalog.register_version(session, model=model, version="v1", artifact="synthetic:?fixed_s=0.001",
                                     sha256=SYNTHETIC_SHA, actor="test", state="stable")
    return models


def test_the_scheduler_publishes_its_plan_when_the_api_server_fails(
        api_server: FakeApiServer, actuator: KubernetesActuator, registry: Registry, rds: redis.Redis,
        redis_url: str) -> None:
    from scheduler.main import Scheduler, autoscaler
    from sluice.settings import Settings

    (model,) = register_versions(registry, 1)
    api_server.failing.add(DEFAULT_TEMPLATE)
    scheduler = Scheduler(registry=registry, redis_url=redis_url, supervisor=actuator,
                          autoscaler=autoscaler(Settings(worker_slots=2)))
    scheduler.tick()
    published = placements.read(rds)
    assert published is not None and published.groups_of((model, "v1"))
    assert rds.hget(keys.replicas(model, "v1"), "desired") == "1"


@pytest.fixture
def process_logging() -> Iterator[None]:
    """The command configures this process's logging as a process of its own would (a handler on
    the runner's captured stream, INFO): put it back, or later tests' output carries log lines."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.usefixtures("process_logging")
@pytest.mark.parametrize("in_cluster", [True, False])
def test_the_cli_accepts_the_kubernetes_actuator_and_chooses_its_configuration(
        in_cluster: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # No cluster here: in a pod the service account's token is missing, outside it the
    # kubeconfig, and the command stops on that, before it opens any store.
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(tmp_path / "no-kubeconfig"))
    env = {"SLUICE_DATABASE_URL": "", "KUBERNETES_SERVICE_HOST": "10.0.0.1" if in_cluster else None,
           "KUBERNETES_SERVICE_PORT": "443"}
    done = CliRunner().invoke(app, ["scheduler", "--actuator", "kubernetes"], env=env)
    assert done.exit_code == 1, done.output
    said = " ".join(done.output.split())
    assert "no Kubernetes configuration" in said
    assert ("token" in said.lower()) is in_cluster, said


def test_the_official_client_is_imported_only_for_the_kubernetes_actuator() -> None:
    probe = "import sys, launch.cli, scheduler.main; print('kubernetes' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
