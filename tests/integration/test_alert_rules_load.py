"""A real Prometheus, given the configuration `sluice up` writes, loads deploy/prometheus/'s rules and
evaluates every group of them without an error."""

from __future__ import annotations

import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from launch.launcher import ALERT_RULES, Platform
from sluice.settings import Settings
from tests.faults._support import free_port
from tests.support import stop_process, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.soak]


def _rule_groups(api: str) -> list[dict[str, Any]]:
    try:
        return list(httpx.get(f"{api}/rules", timeout=2).json()["data"]["groups"])
    except (httpx.HTTPError, ValueError, KeyError):
        return []


def test_prometheus_loads_every_rule_group_and_evaluates_it_with_no_error(tmp_path: Path) -> None:
    prometheus = shutil.which("prometheus")
    assert prometheus, "this test runs a real Prometheus: apt-get install -y prometheus"
    config = Platform(settings=Settings(home=tmp_path / "home")).write_prometheus_config()
    expected = {group["name"]: [rule.get("alert") or rule["record"] for rule in group["rules"]]
                for path in sorted(ALERT_RULES.parent.glob(ALERT_RULES.name))
                for group in yaml.safe_load(path.read_text())["groups"]}
    assert expected
    port = free_port()
    api = f"http://127.0.0.1:{port}/api/v1"
    server = None
    try:
        with (tmp_path / "prometheus.log").open("wb") as sink:
            server = subprocess.Popen(
                [prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{port}"], stdout=sink, stderr=subprocess.STDOUT)

        def every_rule_evaluated() -> bool:
            groups = _rule_groups(api)
            return bool(groups) and all(rule["health"] != "unknown" for group in groups for rule in group["rules"])

        # A group's first evaluation comes within one evaluation interval (15 s) of its load.
        wait_until(every_rule_evaluated, timeout_s=60, what="Prometheus evaluating every rule", interval_s=0.5)
        groups = _rule_groups(api)
        assert {group["name"]: [rule["name"] for rule in group["rules"]] for group in groups} == expected
        unhealthy = [(rule["name"], rule["health"], rule.get("lastError")) for group in groups
                     for rule in group["rules"] if rule["health"] != "ok"]
        assert not unhealthy, unhealthy
    finally:
        stop_process(server, signal.SIGTERM)
