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

import pytest
from kubernetes import client
from kubernetes.config import kube_config
from typer.testing import CliRunner

from launch.cli import app
from scheduler.kubernetes import KubernetesActuator, deployment_name
from sluice.errors import ActuatorError, SluiceError

NS = "sluice"
SCALE_PATH = "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale"
SCALE_ROUTE = re.compile(r"/apis/apps/v1/namespaces/(?P<ns>[^/?]+)/deployments/(?P<name>[^/?]+)/scale")


@dataclass
class FakeApiServer:
    """Deployments by name: [spec.replicas, status.replicas]. `failing` names answer 500."""

    url: str = ""
    deployments: dict[str, list[int]] = field(default_factory=dict)
    failing: set[str] = field(default_factory=set)
    requests: list[dict[str, Any]] = field(default_factory=list)

    def scale(self, name: str) -> dict[str, Any]:
        desired, live = self.deployments[name]
        spec = {"replicas": desired} if desired else {}  # as the API server, which omits a zero
        return {"kind": "Scale", "apiVersion": "autoscaling/v1", "metadata": {"name": name, "namespace": NS},
                "spec": spec, "status": {"replicas": live, "selector": f"app={name}"}}


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
            route = SCALE_ROUTE.fullmatch(self.path)
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


def test_set_desired_patches_the_scale_subresource_with_a_merge_patch(
        api_server: FakeApiServer, actuator: KubernetesActuator) -> None:
    api_server.deployments["sluice-worker-minilm-v1"] = [1, 1]
    actuator.set_desired({("minilm", "v1"): 3})
    path = SCALE_PATH.format(ns=NS, name="sluice-worker-minilm-v1")
    assert [(r["method"], r["path"]) for r in api_server.requests] == [("GET", path), ("PATCH", path)]
    patch = api_server.requests[1]
    assert patch["content_type"] == "application/merge-patch+json"
    assert patch["body"] == {"spec": {"replicas": 3}}
    assert api_server.deployments["sluice-worker-minilm-v1"] == [3, 1]


def test_live_replicas_are_read_from_the_status_not_the_spec(
        api_server: FakeApiServer, actuator: KubernetesActuator) -> None:
    api_server.deployments["sluice-worker-intent-v1"] = [4, 2]
    assert actuator.live(("intent", "v1")) == 2
    assert api_server.requests == [{"method": "GET", "path": SCALE_PATH.format(ns=NS, name="sluice-worker-intent-v1"),
                                    "body": None, "content_type": None}]


def test_an_unchanged_count_sends_no_patch_and_a_zero_spec_reads_as_zero(
        api_server: FakeApiServer, actuator: KubernetesActuator) -> None:
    api_server.deployments["sluice-worker-minilm-v1"] = [2, 2]
    api_server.deployments["sluice-worker-intent-v1"] = [0, 0]
    actuator.set_desired({("minilm", "v1"): 2, ("intent", "v1"): 0})
    assert {r["method"] for r in api_server.requests} == {"GET"}


def test_a_version_that_leaves_the_decisions_is_scaled_to_zero_once(
        api_server: FakeApiServer, actuator: KubernetesActuator) -> None:
    api_server.deployments["sluice-worker-minilm-v1"] = [1, 1]
    api_server.deployments["sluice-worker-minilm-v2"] = [1, 1]
    actuator.set_desired({("minilm", "v1"): 1, ("minilm", "v2"): 1})
    actuator.set_desired({("minilm", "v1"): 1})
    assert api_server.deployments["sluice-worker-minilm-v2"][0] == 0
    api_server.requests.clear()
    actuator.set_desired({("minilm", "v1"): 1})
    assert {r["path"] for r in api_server.requests} == {SCALE_PATH.format(ns=NS, name="sluice-worker-minilm-v1")}


def test_a_missing_deployment_is_skipped_and_logged_once(
        api_server: FakeApiServer, actuator: KubernetesActuator, caplog: pytest.LogCaptureFixture) -> None:
    api_server.deployments["sluice-worker-minilm-v1"] = [1, 1]
    with caplog.at_level(logging.WARNING, logger="scheduler.kubernetes"):
        for _ in range(3):
            actuator.set_desired({("intent", "v9"): 2, ("minilm", "v1"): 2})
    assert actuator.live(("intent", "v9")) == 0
    missing = [r for r in caplog.records if "sluice-worker-intent-v9" in r.getMessage()]
    assert len(missing) == 1, caplog.text
    assert not [r for r in api_server.requests if r["method"] == "PATCH" and "intent" in r["path"]]
    assert api_server.deployments["sluice-worker-minilm-v1"][0] == 2  # the others still scale


def test_a_server_error_becomes_an_actuator_error(
        api_server: FakeApiServer, actuator: KubernetesActuator) -> None:
    api_server.deployments["sluice-worker-minilm-v1"] = [1, 1]
    api_server.failing.add("sluice-worker-minilm-v1")
    with pytest.raises(ActuatorError, match="500") as raised:
        actuator.set_desired({("minilm", "v1"): 2})
    assert isinstance(raised.value, SluiceError)


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
    api_server.deployments["sluice-worker-minilm-v1"] = [1, 1]
    actuator.live(("minilm", "v1"))
    actuator.set_desired({("minilm", "v1"): 1})
    actuator.live(("minilm", "v1"))
    assert len(api_server.requests) == 1
    now[0] += 1.0
    actuator.live(("minilm", "v1"))
    assert len(api_server.requests) == 2


def test_names_are_dns_labels() -> None:
    assert deployment_name("sluice-worker-{model}-{version}", "Intent_Model", "v1.2") == \
        "sluice-worker-intent-model-v1-2"


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
