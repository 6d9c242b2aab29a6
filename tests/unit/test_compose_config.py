"""`compose.yaml` as Compose itself reads it: Debian's docker-compose resolves and checks it
without an engine (`docker-compose config`), which .ci/run installs for this test."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import REPO

SECRETS = {"GRAFANA_ADMIN_PASSWORD": "a-grafana-password", "SLUICE_ADMIN_KEY": "an-admin-key-of-the-test-0123",
           "FLOWER_PASSWORD": "a-flower-password"}
APP_SERVICES = ("api", "worker-pool", "celery-webhooks", "celery-batches")


def _config(**env: str) -> subprocess.CompletedProcess[str]:
    compose = shutil.which("docker-compose")
    assert compose, "this test reads compose.yaml with Compose itself: apt-get install -y docker-compose"
    environment = {k: v for k, v in os.environ.items() if k not in SECRETS and not k.startswith("SLUICE_")} | env
    return subprocess.run([compose, "-f", str(REPO / "compose.yaml"), "config"], env=environment,
                          capture_output=True, text=True, timeout=60, cwd=REPO)


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    done = _config(**SECRETS)
    assert done.returncode == 0, done.stderr
    return dict(yaml.safe_load(done.stdout)["services"])


@pytest.mark.parametrize("secret", sorted(SECRETS))
def test_compose_refuses_to_start_without_each_required_secret(secret: str) -> None:
    done = _config(**{k: v for k, v in SECRETS.items() if k != secret})
    assert done.returncode != 0 and f"set {secret}" in done.stderr, done.stderr


def test_every_published_port_listens_on_loopback_unless_the_api_is_opened(services: dict[str, Any]) -> None:
    published = {name: service["ports"] for name, service in services.items() if service.get("ports")}
    assert set(published) == {"api", "flower", "prometheus", "grafana"}
    for name, ports in published.items():
        assert all(str(port).startswith("127.0.0.1:") for port in ports), (name, ports)
    opened = yaml.safe_load(_config(**SECRETS, SLUICE_API_BIND="0.0.0.0").stdout)["services"]["api"]["ports"]
    assert [str(port) for port in opened] == ["0.0.0.0:8000:8000/tcp"]


def test_the_registry_is_seeded_after_the_migration_and_before_anything_serves(services: dict[str, Any]) -> None:
    assert services["seed"]["command"] == ["sluice", "seed"]
    assert services["seed"]["depends_on"] == {"migrate": {"condition": "service_completed_successfully"}}
    for name in APP_SERVICES:
        assert services[name]["depends_on"]["seed"] == {"condition": "service_completed_successfully"}, name
        environment = services[name]["environment"]
        assert environment["SLUICE_BOOTSTRAP_ADMIN_KEY"] == SECRETS["SLUICE_ADMIN_KEY"], name


def test_flower_asks_for_a_password(services: dict[str, Any]) -> None:
    flower = services["flower"]
    assert flower["environment"]["FLOWER_BASIC_AUTH"] == f"admin:{SECRETS['FLOWER_PASSWORD']}"
    assert "SLUICE_REDIS_URL" in flower["environment"]


def test_workers_run_in_a_pool_the_scheduler_supervises_so_registering_a_version_is_enough(
    services: dict[str, Any],
) -> None:
    assert services["worker-pool"]["command"] == ["sluice", "scheduler", "--actuator", "local"]
    # Its processes pick their own metrics ports and are found through the API's discovery.
    assert services["worker-pool"]["environment"]["SLUICE_METRICS_PORT"] == "0"
    assert not [name for name, service in services.items() if "--actuator" in service.get("command", [])
                and "none" in service["command"]]
    assert not [name for name in services if name.startswith("worker-") and name != "worker-pool"]


def test_prometheus_reads_the_apis_discovery_and_its_configuration_is_valid() -> None:
    config = yaml.safe_load((REPO / "docker" / "prometheus.yml").read_text())
    [discovered] = [job for job in config["scrape_configs"] if "http_sd_configs" in job]
    assert discovered["http_sd_configs"] == [{"url": "http://api:8000/metrics/targets", "refresh_interval": "15s"}]
    promtool = shutil.which("promtool")
    assert promtool, "Debian's prometheus package ships promtool: apt-get install -y prometheus"
    done = subprocess.run([promtool, "check", "config", str(REPO / "docker" / "prometheus.yml")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_prometheus_loads_the_alert_rules_compose_mounts(services: dict[str, Any]) -> None:
    config = yaml.safe_load((REPO / "docker" / "prometheus.yml").read_text())
    (rules,) = config["rule_files"]
    mounts = [str(volume).split(":") for volume in services["prometheus"]["volumes"]]
    (source,) = [source for source, target, *_ in mounts if target == str(Path(rules).parent)]
    assert Path(source) == REPO / "deploy" / "prometheus"
    assert list(Path(source).glob(Path(rules).name)), f"{rules} matches no file of {source}"
