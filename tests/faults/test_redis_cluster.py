"""Part of the suite, run again on a Redis Cluster: three masters of the machine's
`redis-server` on local ports (tests/redis_cluster.py), and a pytest of its own pointed at them.

The modules below cover the job path (single, bulk, long-poll, events), idempotency, cancel,
webhooks (relay, delivery, beat), admission (quota and rate), the response cache, the worker's
exactly-once transitions, batch scoring and the worker-kill fault test. They run unchanged: the
session's `redis_url` is the cluster's `redis+cluster://` URL, so the API, the workers and the
Celery worker all build redis-py's cluster client. Celery's broker is a single Redis of the run's
own (Celery's transport does not speak Cluster).

A test that cannot mean anything on a cluster says so and skips (it counts the round trips of one
connection, or the commands one node answers); every other test must pass.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.faults._support import RedisServer
from tests.redis_cluster import LocalCluster, running_cluster
from tests.support import REPO

pytestmark = pytest.mark.soak

MODULES = [
    "tests/integration/test_e2e.py",
    "tests/integration/test_client.py",
    "tests/integration/test_idempotency.py",
    "tests/integration/test_api_rejections.py",
    "tests/integration/test_admission.py",
    "tests/integration/test_response_cache.py",
    "tests/integration/test_wait_many.py",
    "tests/integration/test_webhooks.py",
    "tests/integration/test_delivery.py",
    "tests/integration/test_exactly_once.py",
    "tests/integration/test_round_trips.py",
    "tests/integration/test_worker.py",
    "tests/integration/test_batches.py",
    "tests/faults/test_worker_kill.py",
]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    with running_cluster(tmp_path / "cluster") as made:
        yield made


@pytest.fixture
def celery_broker(tmp_path: Path) -> Iterator[str]:
    """A single redis-server of the run's own for Celery's broker and results."""
    directory = tmp_path / "broker"
    directory.mkdir()
    server = RedisServer(directory=directory, persistence={"save": ""})
    server.start()
    yield server.url
    server.stop()


def test_the_job_path_webhooks_admission_and_a_worker_kill_pass_on_a_redis_cluster(
    cluster: LocalCluster, celery_broker: str, tmp_path: Path, figure: Callable[[str, object], None],
) -> None:
    report = tmp_path / "cluster.xml"
    env = {**os.environ, "SLUICE_TEST_REDIS_URL": cluster.url, "SLUICE_TEST_CELERY_BROKER_URL": celery_broker}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", f"--junitxml={report}", *MODULES],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1200,
    )
    assert run.returncode == 0, run.stdout[-12_000:] + run.stderr[-4_000:]
    suite = ElementTree.parse(report).getroot().find("testsuite")
    assert suite is not None
    counts = {name: int(suite.get(name, "0")) for name in ("tests", "failures", "errors", "skipped")}
    figure("cluster_nodes", len(cluster.nodes))
    figure("cluster_tests", counts)
    assert counts["tests"] >= 150 and counts["failures"] == counts["errors"] == 0
    # Only the tests that count what one connection sends or one node answers may skip, and say so.
    skipped = {str(case.get("name")): str(reason.get("message", "")) for case in suite.iter("testcase")
               if (reason := case.find("skipped")) is not None}
    assert all(("one connection" in why or "one node" in why) for why in skipped.values()), skipped
    for case in suite.iter("testcase"):
        if case.get("name") == "test_sigkill_mid_batch_loses_no_job":
            for prop in case.iter("property"):
                figure(f"worker_kill_on_cluster.{prop.get('name')}", prop.get("value"))
