"""After a known load: the stats resource counts what was submitted, and the histograms a worker
serves from its own endpoint (found where it advertises itself) agree with it; the request id a
client sent reaches the worker's JSON log lines."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from sluice import exposition
from sluice.wire import keys
from tests.support import ApiServer, WorkerProcess

pytestmark = pytest.mark.slow

JOBS = 320  # past P99_MIN_SAMPLES, so the stats resource reports a p99


def _families(text: str) -> dict[str, list[Any]]:
    families: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(text):
        families.setdefault(family.name, []).extend(family.samples)
    return families


def _value(samples: list[Any], name: str, **labels: str) -> float:
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def _worker_metrics(rds: redis.Redis, model: str) -> tuple[str, dict[str, list[Any]]]:
    """The address and /metrics of the advertised worker endpoint that serves `model`."""
    found = []
    for target in exposition.live_targets(rds, now=time.time()):
        if target.process != "worker":
            continue
        try:
            text = httpx.get(f"http://{target.address}/metrics", timeout=5).text
        except httpx.HTTPError:
            continue  # a worker of another test that just stopped
        if f'model="{model}"' in text:
            found.append((target.address, _families(text)))
    assert len(found) == 1, f"{len(found)} advertised worker endpoints serve {model}"
    return found[0]


MAX_WAIT_MS = 20


def test_stats_and_worker_histograms_agree_after_a_known_load(
    demo: httpx.Client, admin: httpx.Client, rds: redis.Redis, register_synthetic: Callable[..., str],
    start_worker: Callable[..., WorkerProcess], wait_jobs: Callable[..., list[dict[str, Any]]],
) -> None:
    model = register_synthetic("observed", max_batch_size=8, max_wait_ms=MAX_WAIT_MS)
    worker = start_worker(model)

    traced = demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": "traced"}},
                       headers={"X-Request-Id": "trace-7f3a"})
    assert traced.status_code == 202, traced.text
    assert traced.headers["X-Request-Id"] == "trace-7f3a"
    ids = [traced.json()["id"]]
    for chunk in range(4):
        response = demo.post(f"/v1/models/{model}/jobs:bulk",
                             json={"inputs": [{"text": "x " * (1 + (i % 40))} for i in range(75)]})
        assert response.status_code == 202, response.text
        assert response.headers["X-Request-Id"].startswith("req_")
        ids += response.json()["ids"]
        time.sleep(0.2 * chunk)
    ids += [demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": "late"}}).json()["id"]
            for _ in range(JOBS - len(ids))]
    assert len(ids) == JOBS
    assert {job["status"] for job in wait_jobs(demo, ids)} == {"succeeded"}

    stats = admin.get(f"/v1/models/{model}/versions/v1/stats", params={"window_s": 3600}).json()
    assert stats["count"] == JOBS and stats["errors"] == 0
    for series in ("queue_wait_ms", "model_ms", "total_ms"):
        p = stats[series]
        assert p["p99"] is not None, stats
        assert 0 <= p["p50"] <= p["p95"] <= p["p99"], (series, p)
    batches = sum(stats["close_reasons"].values())
    assert sum(stats["batch_size"]["histogram"].values()) == batches > JOBS / 8 - 1
    assert sum(int(size) * n for size, n in stats["batch_size"]["histogram"].items()) == JOBS

    # The worker advertises within a beat of starting; its counters are final once the jobs are.
    address, metrics = _worker_metrics(rds, model)
    # Summed over lanes: jobs:bulk queues on the bulk lane, single jobs on the online lane.
    version = {"model": model, "version": "v1"}
    assert _value(metrics["sluice_jobs_finished"], "sluice_jobs_finished_total", status="succeeded",
                  **version) == JOBS
    assert _value(metrics["sluice_queue_wait_seconds"], "sluice_queue_wait_seconds_count", lane="online",
                  **version) == JOBS - 300
    assert _value(metrics["sluice_queue_wait_seconds"], "sluice_queue_wait_seconds_count", **version) == JOBS
    assert _value(metrics["sluice_job_seconds"], "sluice_job_seconds_count", **version) == JOBS
    assert _value(metrics["sluice_batch_size"], "sluice_batch_size_count", **version) == batches
    assert _value(metrics["sluice_batch_size"], "sluice_batch_size_sum", **version) == JOBS
    assert _value(metrics["sluice_batch_fill_seconds"], "sluice_batch_fill_seconds_count", **version) == batches
    assert 0 <= _value(metrics["sluice_batch_window_seconds"], "sluice_batch_window_seconds", lane="online",
                       **version) <= MAX_WAIT_MS / 1000
    for reason, count in stats["close_reasons"].items():
        assert _value(metrics["sluice_batches"], "sluice_batches_total", reason=reason, **version) == count, reason
    # The histograms' own view of the median agrees with the exact one within a bucket.
    wait_sum = _value(metrics["sluice_queue_wait_seconds"], "sluice_queue_wait_seconds_sum", **version)
    assert wait_sum / JOBS * 1000 >= stats["queue_wait_ms"]["p50"] / 4

    # The caller's request id, carried in the job record and its stream entry, is in the worker's log.
    assert worker.terminate() == 0
    lines = [json.loads(line) for line in worker.log_path.read_text().splitlines() if line.startswith("{")]
    assert lines and all({"time", "level", "logger", "message", "process"} <= set(line) for line in lines)
    traced_lines = [line for line in lines if "trace-7f3a" in line.get("request_ids", [])]
    assert traced_lines and ids[0] in traced_lines[0]["job_ids"], lines[-3:]
    # A worker that stops withdraws its endpoint at once, not when its advertisement lapses.
    assert address not in {t.address for t in exposition.live_targets(rds, now=time.time())}


def test_the_api_serves_the_advertised_endpoints_for_prometheus_http_discovery(
    api: ApiServer, rds: redis.Redis,
) -> None:
    """What compose's Prometheus scrapes: every live advertisement, in file-SD form, without a key
    (like /metrics); a withdrawn or lapsed one is gone."""
    live = exposition.ScrapeTarget(address="pool-1:40001", process="worker", labels={"model": "m"})
    lapsed = exposition.ScrapeTarget(address="pool-1:40002", process="worker")
    exposition.advertise(rds, live, now=time.time())
    rds.zadd(keys.scrape_targets(), {lapsed.to_member(): time.time() - exposition.LIVE_WITHIN_S - 1})
    try:
        groups = httpx.get(f"{api.url}/metrics/targets", timeout=10).json()
        assert {"targets": ["pool-1:40001"], "labels": {"process": "worker", "model": "m"}} in groups
        assert all("pool-1:40002" not in group["targets"] for group in groups)
        exposition.withdraw(rds, live)
        groups = httpx.get(f"{api.url}/metrics/targets", timeout=10).json()
        assert all("pool-1:40001" not in group["targets"] for group in groups)
    finally:
        exposition.withdraw(rds, live)
        exposition.withdraw(rds, lapsed)
