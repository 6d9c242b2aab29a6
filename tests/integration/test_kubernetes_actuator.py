"""The kubernetes actuator against a local HTTP server that answers the scale subresource as the
API server does, through the official client: the requests it sends, the replicas it reads back,
and what a missing Deployment, a refusal and no connection become. No cluster is needed."""

from __future__ import annotations

import json
import logging
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import pytest
import redis
from kubernetes import client
from kubernetes.config import kube_config
from prometheus_client import REGISTRY
from typer.testing import CliRunner

from launch.cli import app
from scheduler.kubernetes import DEFAULT_TEMPLATE, KubernetesActuator, deployment_name
from sluice.errors import ActuatorError, SluiceError
from sluice.registry import catalog
from sluice.registry.store import Registry
from sluice.wire import keys
from tests.support import SYNTHETIC_SHA, unique

NS = "sluice"
SCALE_PATH = "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale"
SCALE_ROUTE = re.compile(r"/apis/apps/v1/namespaces/(?P<ns>[^/?]+)/deployments/(?P<name>[^/?]+)/scale")
LIST_ROUTE = re.compile(r"/apis/apps/v1/namespaces/(?P<ns>[^/?]+)/deployments")


WORKER_LABELS = {"app.kubernetes.io/component": "worker"}


@dataclass
class FakeApiServer:
    """Deployments by name: [spec.replicas, status.replicas]. `failing` names answer 500, and so does
    the list while `list_fails`; `labels` are a Deployment's own when not the workers'."""

    url: str = ""
    deployments: dict[str, list[int]] = field(default_factory=dict)
    labels: dict[str, dict[str, str]] = field(default_factory=dict)
    failing: set[str] = field(default_factory=set)
    list_fails: bool = False
    requests: list[dict[str, Any]] = field(default_factory=list)

    def scale(self, name: str) -> dict[str, Any]:
        desired, live = self.deployments[name]
        spec = {"replicas": desired} if desired else {}  # as the API server, which omits a zero
        return {"kind": "Scale", "apiVersion": "autoscaling/v1", "metadata": {"name": name, "namespace": NS},
                "spec": spec, "status": {"replicas": live, "selector": f"app={name}"}}

    def listing(self, selector: str) -> dict[str, Any]:
        wanted = dict(part.split("=", 1) for part in selector.split(",") if part)
        items = []
        for name, (desired, live) in self.deployments.items():
            labels = self.labels.get(name, WORKER_LABELS)
            if wanted.items() <= labels.items():
                items.append({"metadata": {"name": name, "namespace": NS, "labels": labels},
                              "spec": {"replicas": desired, "selector": {"matchLabels": labels},
                                       "template": {"metadata": {"labels": labels},
                                                    "spec": {"containers": [{"name": "worker"}]}}},
                              "status": {"replicas": live}})
        return {"kind": "DeploymentList", "apiVersion": "apps/v1", "metadata": {}, "items": items}


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
            server.requests.append({"method": self.command, "path": self.path, "body": body,
                                    "content_type": self.headers.get("Content-Type")})
            path, _, query = self.path.partition("?")
            listed = LIST_ROUTE.fullmatch(path)
            if listed is not None and listed["ns"] == NS and self.command == "GET":
                if server.list_fails:
                    self._answer(500, {"kind": "Status", "code": 500, "reason": "InternalError", "message": "etcd"})
                else:
                    selector = parse_qs(query).get("labelSelector", [""])[0]
                    self._answer(200, server.listing(selector))
                return
            route = SCALE_ROUTE.fullmatch(path)
            name = route["name"] if route else ""
            if route is None or route["ns"] != NS:
                self._answer(400, {"kind": "Status", "code": 400, "reason": "BadRequest"})
            elif name in server.failing:
                self._answer(500, {"kind": "Status", "code": 500, "reason": "InternalError", "message": "etcd"})
            elif name not in server.deployments:
                self._answer(404, {"kind": "Status", "code": 404, "reason": "NotFound",
                                   "message": f'deployments.apps "{name}" not found'})
            else:
                if self.command == "PATCH":
                    server.deployments[name][0] = body["spec"]["replicas"]
                self._answer(200, server.scale(name))

        do_GET = do_PATCH = _serve

    return Handler


@pytest.fixture
def api_server() -> Iterator[FakeApiServer]:
    fake = FakeApiServer()
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
    # max_age_s=0: every call goes to the server, so each test sees every request.
    return KubernetesActuator(apps=_apps(api_server.url), namespace=NS, max_age_s=0)


def _name(model: str, version: str = "v1") -> str:
    return deployment_name(DEFAULT_TEMPLATE, model, version)


def register_versions(registry: Registry, count: int) -> list[str]:
    """Models of one stable synthetic version (v1) each, at least one replica."""
    models = [unique("k8s") for _ in range(count)]
    with registry.session() as session:
        for model in models:
            catalog.create_model(session, name=model, kind="synthetic", actor="test")
            catalog.register_version(session, model=model, version="v1", artifact="synthetic:?fixed_s=0.001",
                                     sha256=SYNTHETIC_SHA, actor="test", state="stable")
    return models


def _scale_requests(api_server: FakeApiServer) -> list[dict[str, Any]]:
    """The requests to a scale subresource: the list of the first call is the adoption tests' own."""
    return [r for r in api_server.requests if SCALE_ROUTE.fullmatch(r["path"])]


def test_set_desired_patches_the_scale_subresource_with_a_merge_patch(
        api_server: FakeApiServer, actuator: KubernetesActuator) -> None:
    api_server.deployments[_name("minilm")] = [1, 1]
    actuator.set_desired({("minilm", "v1"): 3})
    path = SCALE_PATH.format(ns=NS, name=_name("minilm"))
    requests = _scale_requests(api_server)
    assert [(r["method"], r["path"]) for r in requests] == [("GET", path), ("PATCH", path)]
    patch = requests[1]
    assert patch["content_type"] == "application/merge-patch+json"
    assert patch["body"] == {"spec": {"replicas": 3}}
    assert api_server.deployments[_name("minilm")] == [3, 1]


def test_live_replicas_are_read_from_the_status_not_the_spec(
        api_server: FakeApiServer, actuator: KubernetesActuator) -> None:
    api_server.deployments[_name("intent")] = [4, 2]
    assert actuator.live(("intent", "v1")) == 2
    assert api_server.requests == [{"method": "GET", "path": SCALE_PATH.format(ns=NS, name=_name("intent")),
                                    "body": None, "content_type": None}]


def test_an_unchanged_count_sends_no_patch_and_a_zero_spec_reads_as_zero(
        api_server: FakeApiServer, actuator: KubernetesActuator) -> None:
    api_server.deployments[_name("minilm")] = [2, 2]
    api_server.deployments[_name("intent")] = [0, 0]
    actuator.set_desired({("minilm", "v1"): 2, ("intent", "v1"): 0})
    assert {r["method"] for r in api_server.requests} == {"GET"}


def test_a_version_that_leaves_the_decisions_is_scaled_to_zero_once(
        api_server: FakeApiServer, actuator: KubernetesActuator) -> None:
    api_server.deployments[_name("minilm")] = [1, 1]
    api_server.deployments[_name("minilm", "v2")] = [1, 1]
    actuator.set_desired({("minilm", "v1"): 1, ("minilm", "v2"): 1})
    actuator.set_desired({("minilm", "v1"): 1})
    assert api_server.deployments[_name("minilm", "v2")][0] == 0
    api_server.requests.clear()
    actuator.set_desired({("minilm", "v1"): 1})
    assert {r["path"] for r in api_server.requests} == {SCALE_PATH.format(ns=NS, name=_name("minilm"))}


def test_versions_whose_names_read_alike_scale_their_own_deployments(
        api_server: FakeApiServer, actuator: KubernetesActuator) -> None:
    api_server.deployments[_name("minilm", "v2-int8")] = [1, 1]
    api_server.deployments[_name("minilm-v2", "int8")] = [1, 1]
    actuator.set_desired({("minilm", "v2-int8"): 3, ("minilm-v2", "int8"): 2})
    assert api_server.deployments[_name("minilm", "v2-int8")][0] == 3
    assert api_server.deployments[_name("minilm-v2", "int8")][0] == 2


def test_a_missing_deployment_is_skipped_and_logged_once(
        api_server: FakeApiServer, actuator: KubernetesActuator, caplog: pytest.LogCaptureFixture) -> None:
    api_server.deployments[_name("minilm")] = [1, 1]
    with caplog.at_level(logging.WARNING, logger="scheduler.kubernetes"):
        for _ in range(3):
            actuator.set_desired({("intent", "v9"): 2, ("minilm", "v1"): 2})
    assert actuator.live(("intent", "v9")) == 0
    missing = [r for r in caplog.records if _name("intent", "v9") in r.getMessage()]
    assert len(missing) == 1, caplog.text
    assert not [r for r in api_server.requests if r["method"] == "PATCH" and "intent" in r["path"]]
    assert api_server.deployments[_name("minilm")][0] == 2  # the others still scale


def test_a_server_error_on_a_read_becomes_an_actuator_error(
        api_server: FakeApiServer, actuator: KubernetesActuator) -> None:
    api_server.deployments[_name("minilm")] = [1, 1]
    api_server.failing.add(_name("minilm"))
    with pytest.raises(ActuatorError, match="500") as raised:
        actuator.live(("minilm", "v1"))
    assert isinstance(raised.value, SluiceError)


def _errors(operation: str) -> float:
    return REGISTRY.get_sample_value("sluice_actuator_errors_total", {"operation": operation}) or 0.0


def test_a_failing_deployment_is_counted_and_the_versions_after_it_still_scale(
        api_server: FakeApiServer, actuator: KubernetesActuator, caplog: pytest.LogCaptureFixture) -> None:
    for model in ("alpha", "beta", "gamma"):
        api_server.deployments[_name(model)] = [1, 1]
    api_server.failing.add(_name("beta"))
    before = _errors("read")
    with caplog.at_level(logging.WARNING, logger="scheduler.kubernetes"):
        actuator.set_desired({("alpha", "v1"): 2, ("beta", "v1"): 2, ("gamma", "v1"): 2})
    assert api_server.deployments[_name("alpha")][0] == 2
    assert api_server.deployments[_name("gamma")][0] == 2
    assert _errors("read") == before + 1
    assert _name("beta") in caplog.text


def test_a_version_that_failed_to_reach_zero_is_tried_again(
        api_server: FakeApiServer, actuator: KubernetesActuator) -> None:
    api_server.deployments[_name("minilm")] = [1, 1]
    api_server.deployments[_name("minilm", "v2")] = [1, 1]
    actuator.set_desired({("minilm", "v1"): 1, ("minilm", "v2"): 1})
    api_server.failing.add(_name("minilm", "v2"))
    actuator.set_desired({("minilm", "v1"): 1})
    api_server.failing.clear()
    actuator.set_desired({("minilm", "v1"): 1})
    assert api_server.deployments[_name("minilm", "v2")][0] == 0


def test_on_start_deployments_of_versions_no_longer_decided_are_scaled_to_zero(
        api_server: FakeApiServer, actuator: KubernetesActuator) -> None:
    # minilm v1 was retired while no scheduler ran: the new one never decided it, and still owns it.
    api_server.deployments[_name("minilm")] = [3, 3]
    api_server.deployments[_name("minilm", "v2")] = [1, 1]
    api_server.deployments[_name("idle")] = [0, 0]
    api_server.deployments["sluice-api"] = [2, 2]
    api_server.labels["sluice-api"] = {"app.kubernetes.io/component": "api"}
    actuator.set_desired({("minilm", "v2"): 2})
    assert api_server.deployments[_name("minilm")][0] == 0
    assert api_server.deployments[_name("minilm", "v2")][0] == 2
    assert api_server.deployments["sluice-api"][0] == 2, "only worker Deployments are the scheduler's"
    assert not [r for r in api_server.requests if _name("idle") in r["path"]], "one at zero needs nothing"
    listed = [r for r in api_server.requests if LIST_ROUTE.fullmatch(r["path"].partition("?")[0])]
    assert len(listed) == 1
    assert parse_qs(listed[0]["path"].partition("?")[2]) == {"labelSelector": ["app.kubernetes.io/component=worker"]}
    api_server.requests.clear()
    actuator.set_desired({("minilm", "v2"): 2})
    assert {r["path"] for r in api_server.requests} == {SCALE_PATH.format(ns=NS, name=_name("minilm", "v2"))}


def test_a_failed_listing_is_counted_and_tried_again_on_the_next_call(
        api_server: FakeApiServer, actuator: KubernetesActuator) -> None:
    api_server.deployments[_name("minilm")] = [3, 3]
    api_server.deployments[_name("minilm", "v2")] = [1, 1]
    api_server.list_fails = True
    before = _errors("list")
    actuator.set_desired({("minilm", "v2"): 2})
    assert api_server.deployments[_name("minilm", "v2")][0] == 2, "the decided versions scale without it"
    assert _errors("list") == before + 1
    api_server.list_fails = False
    actuator.set_desired({("minilm", "v2"): 2})
    assert api_server.deployments[_name("minilm")][0] == 0


def test_no_connection_becomes_an_actuator_error() -> None:
    with socket.socket() as sock:  # a port nothing listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    actuator = KubernetesActuator(apps=_apps(f"http://127.0.0.1:{port}"), namespace=NS)
    with pytest.raises(ActuatorError, match="unreachable"):
        actuator.live(("minilm", "v1"))


def test_a_read_is_reused_within_its_age(api_server: FakeApiServer) -> None:
    now = [100.0]
    actuator = KubernetesActuator(apps=_apps(api_server.url), namespace=NS, max_age_s=1.0, clock=lambda: now[0])
    api_server.deployments[_name("minilm")] = [1, 1]
    actuator.live(("minilm", "v1"))
    actuator.set_desired({("minilm", "v1"): 1})
    actuator.live(("minilm", "v1"))
    assert len(_scale_requests(api_server)) == 1
    now[0] += 1.0
    actuator.live(("minilm", "v1"))
    assert len(_scale_requests(api_server)) == 2


def test_the_scheduler_publishes_its_decisions_when_a_deployment_fails(
        api_server: FakeApiServer, actuator: KubernetesActuator, registry: Registry, rds: redis.Redis,
        redis_url: str) -> None:
    from scheduler.main import Scheduler, autoscaler
    from sluice.settings import Settings

    broken, fine = register_versions(registry, 2)
    api_server.deployments[_name(broken)] = [1, 1]
    api_server.deployments[_name(fine)] = [0, 0]
    api_server.failing.add(_name(broken))
    scheduler = Scheduler(registry=registry, redis_url=redis_url, supervisor=actuator,
                          autoscaler=autoscaler(Settings(worker_slots=10_000)))
    scheduler.tick()
    assert api_server.deployments[_name(fine)][0] == 1, "the version after the failing one is scaled"
    for model in (broken, fine):
        assert rds.hget(keys.replicas(model, "v1"), "desired") == "1", model


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
