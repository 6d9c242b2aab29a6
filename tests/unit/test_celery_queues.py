"""Webhook deliveries and batch feeding have pools of their own: each task's queue is the app's
route, and every way of running Sluice (`sluice up`, compose.yaml, the Kubernetes base) runs one
Celery worker per queue, beat in exactly one, so a feeder (a thread for its whole batch) never
holds a thread a delivery needs."""

from __future__ import annotations

import importlib
import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml

from sluice.settings import Settings
from workers.tasks import DELIVER_TASK, RUN_BATCH_TASK, SWEEP_BATCHES_TASK, SWEEP_TASK, create_app

REPO = Path(__file__).resolve().parents[2]
SETTINGS = Settings(redis_url="redis://127.0.0.1:1/0", database_url="postgresql+psycopg://x@127.0.0.1:1/x")


def _routes() -> dict[str, str]:
    app = create_app(settings=SETTINGS)
    return {task: app.amqp.router.route({}, task)["queue"].name
            for task in (DELIVER_TASK, SWEEP_TASK, RUN_BATCH_TASK, SWEEP_BATCHES_TASK)}


def _worker(argv: list[str]) -> tuple[frozenset[str], bool]:
    """The queues a `celery ... worker` command line consumes (empty: all of the app's) and whether
    it runs beat."""
    queues: set[str] = set()
    for flag, value in zip(argv, argv[1:], strict=False):
        if flag in {"-Q", "--queues"}:
            queues.update(value.split(","))
    return frozenset(queues), "--beat" in argv or "-B" in argv


def _check_one_worker_per_queue(workers: dict[str, list[str]]) -> None:
    routes = _routes()
    consumed = {name: _worker(argv) for name, argv in workers.items()}
    assert all(len(queues) == 1 for queues, _ in consumed.values()), consumed
    assert sorted(q for queues, _ in consumed.values() for q in queues) == sorted(set(routes.values())), consumed
    [beat] = [queues for queues, beats in consumed.values() if beats]
    assert beat == {routes[DELIVER_TASK]}, consumed


def test_deliveries_and_batch_feeding_are_routed_to_queues_of_their_own() -> None:
    routes = _routes()
    assert routes[DELIVER_TASK] == routes[SWEEP_TASK]
    assert routes[RUN_BATCH_TASK] == routes[SWEEP_BATCHES_TASK]
    assert routes[DELIVER_TASK] != routes[RUN_BATCH_TASK], routes
    # A worker started without -Q consumes every queue: one process still serves a small installation.
    assert set(create_app(settings=SETTINGS).amqp.queues) == set(routes.values())


def test_sluice_up_runs_one_worker_per_queue_with_its_own_threads() -> None:
    from launch.launcher import celery_workers

    workers = dict(celery_workers(SETTINGS))
    _check_one_worker_per_queue(workers)
    threads = {name: int(argv[argv.index("--concurrency") + 1]) for name, argv in workers.items()}
    by_queue = {next(iter(_worker(argv)[0])): threads[name] for name, argv in workers.items()}
    routes = _routes()
    assert by_queue[routes[DELIVER_TASK]] == SETTINGS.webhook_concurrency
    # Every feeder, and one thread for the sweep that hands out batches and due schedule slots.
    assert by_queue[routes[RUN_BATCH_TASK]] == SETTINGS.batch_feeders_per_worker + 1


def test_compose_runs_one_worker_per_queue() -> None:
    services: dict[str, Any] = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]
    workers = {name: service["command"] for name, service in services.items()
               if service.get("command", [])[:4] == ["celery", "-A", "workers.tasks", "worker"]}
    _check_one_worker_per_queue(workers)


def test_the_kubernetes_base_runs_one_worker_deployment_per_queue() -> None:
    base = REPO / "deploy" / "kubernetes" / "base"
    docs = [doc for path in sorted(base.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]
    workers = {}
    for doc in docs:
        if doc["kind"] != "Deployment":
            continue
        [container] = doc["spec"]["template"]["spec"]["containers"]
        if container["args"][:4] == ["celery", "-A", "workers.tasks", "worker"]:
            workers[doc["metadata"]["name"]] = [str(arg) for arg in container["args"]]
            # Two Deployments must never select each other's pods.
            assert doc["spec"]["selector"]["matchLabels"] == doc["spec"]["template"]["metadata"]["labels"]
    _check_one_worker_per_queue(workers)
    selectors = [tuple(sorted(doc["spec"]["selector"]["matchLabels"].items())) for doc in docs
                 if doc["kind"] == "Deployment" and doc["metadata"]["name"] in workers]
    assert len(set(selectors)) == len(selectors)


@pytest.mark.parametrize("task", [DELIVER_TASK, SWEEP_TASK, RUN_BATCH_TASK, SWEEP_BATCHES_TASK])
def test_no_task_goes_to_celerys_default_queue_which_no_worker_consumes(task: str) -> None:
    assert _routes()[task] != "celery"


def test_beat_sends_the_nightly_retune_to_the_batch_queue_where_the_included_module_registers_it() -> None:
    from celery.exceptions import DuplicateTaskNameWarning
    from celery.schedules import crontab

    from sluice.vocabulary import RETUNE_TASK

    app = create_app(settings=SETTINGS.model_copy(update={"retune_hour_utc": 4}))
    assert app.amqp.router.route({}, RETUNE_TASK)["queue"].name == _routes()[RUN_BATCH_TASK]
    entry = app.conf.beat_schedule["sluice-retune"]
    assert entry["task"] == RETUNE_TASK
    assert entry["schedule"] == crontab(minute=0, hour=4)
    # A worker imports the app's `include` at start: the module registers the task on the app.
    assert list(app.conf.include) == ["scheduler.retune_task"]
    importlib.import_module("scheduler.retune_task")
    # Finalizing a second app in one process registers every app's tasks again (Celery's shared
    # tasks): a warning a worker, with its one app, never meets.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DuplicateTaskNameWarning)
        assert RETUNE_TASK in app.tasks
