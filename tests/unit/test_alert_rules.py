"""deploy/prometheus/: the alert rules are valid, every alert fires on a series that should fire it
and stays silent on one that should not (`promtool test rules`, Debian's prometheus package, which
.ci/run installs), and the rules name only series the platform exports."""

from __future__ import annotations

import re
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY

from sluice.batcher import Batch, Item
from sluice.metrics import JOB_SECONDS, JOBS_OVER_BUDGET
from sluice.settings import Settings
from tests.support import REPO
from workers.execution import Outcome
from workers.metrics import BatchMetrics
from workers.results import Delivery

RULES = REPO / "deploy" / "prometheus"
RULE_FILES = sorted(RULES.glob("*.rules.yml"))
RULE_TESTS = sorted((RULES / "tests").glob("*.yml"))
# Written against the name of the mix-drift gauge, which its workers export once they measure it.
NOT_YET_EXPORTED = {"sluice_mix_drift"}
SERIES = re.compile(r"\b(sluice_[a-z0-9_]+)\b(?!:)")


def _promtool() -> str:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is absent: apt-get install -y prometheus (Debian's package ships it)")
    return promtool


def _rules() -> list[dict[str, Any]]:
    return [rule for path in RULE_FILES for group in yaml.safe_load(path.read_text())["groups"]
            for rule in group["rules"]]


def _exported() -> set[str]:
    """Every series name the platform's metrics serve, whether or not a series has a sample yet."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    return {metric.name + suffix for metric in REGISTRY.collect() for suffix in suffixes.get(metric.type, ())}


def test_the_rule_files_are_valid() -> None:
    assert RULE_FILES
    done = subprocess.run([_promtool(), "check", "rules", *map(str, RULE_FILES)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_fires_and_stays_silent_as_its_tests_say() -> None:
    assert RULE_TESTS
    done = subprocess.run([_promtool(), "test", "rules", *map(str, RULE_TESTS)],
                          capture_output=True, text=True, timeout=120, cwd=RULES / "tests")
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_has_a_firing_case_and_a_silent_one() -> None:
    firing: set[str] = set()
    silent: set[str] = set()
    for path in RULE_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (firing if check.get("exp_alerts") else silent).add(check["alertname"])
    alerts = {rule["alert"] for rule in _rules() if "alert" in rule}
    assert alerts <= firing, alerts - firing
    assert alerts <= silent, alerts - silent


def test_the_rules_read_only_series_the_platform_exports() -> None:
    named = {name for rule in _rules() for name in SERIES.findall(rule["expr"])}
    assert named
    assert named - NOT_YET_EXPORTED <= _exported(), named - NOT_YET_EXPORTED - _exported()


def test_a_worker_counts_the_jobs_over_its_versions_own_budget() -> None:
    """The latency SLO's bad events (sluice_jobs_over_budget_total) are counted by the worker
    against the version's `latency_budget_ms`, whatever the histogram's buckets."""
    model = f"budget-{uuid.uuid4().hex[:6]}"
    metrics = BatchMetrics(model=model, version="v1", latency_budget_s=0.3)
    finished = 1000.0
    items = tuple(Item(id=str(i), tenant="t", cost=1, enqueued_at=finished - waited,
                       payload=Delivery(job_id=str(i), lane="online", input={}, attempts=1, arrived_at=finished - 0.01))
                  for i, waited in enumerate((0.1, 0.29, 0.31, 2.0)))
    batch = Batch(items=items, close_reason="size", bucket=0, tenant="t", closed_at=finished - 0.01)
    metrics.batch(batch, [Outcome(output={}) for _ in items], [True, True, True, False], started=finished - 0.01,
                  model_s=0.01, finished=finished, window_s=0.01)
    # The fourth job's outcome was another delivery's: it counts there, not here.
    assert JOBS_OVER_BUDGET.labels(model, "v1", "online")._value.get() == 1
    assert JOB_SECONDS.labels(model, "v1", "online")._sum.get() == pytest.approx(0.1 + 0.29 + 0.31)


def test_the_configuration_sluice_up_writes_loads_the_rule_files(tmp_path: Path) -> None:
    from launch.launcher import ALERT_RULES, Platform

    path = Platform(settings=Settings(home=tmp_path)).write_prometheus_config()
    assert yaml.safe_load(path.read_text())["rule_files"] == [str(ALERT_RULES)]
    assert sorted(ALERT_RULES.parent.glob(ALERT_RULES.name)) == RULE_FILES
    # promtool reads the rule files a configuration names, and says how many rules it found.
    done = subprocess.run([_promtool(), "check", "config", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in done.stdout, done.stdout
