"""One scrape of the API's /metrics shows every version's queue: lag, pending, oldest entry, live workers."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.support import wait_until


def _gauges(anon: httpx.Client, model: str) -> dict[tuple[str, str], float]:
    """(metric, lane or "") -> value, for the model's v1."""
    values = {}
    for family in text_string_to_metric_families(anon.get("/metrics").text):
        for sample in family.samples:
            if sample.labels.get("model") == model and sample.labels.get("version") == "v1":
                values[(sample.name, sample.labels.get("lane", ""))] = sample.value
    return values


def test_the_api_metrics_show_the_queue_of_a_version_with_no_worker_then_with_one(
    anon: httpx.Client, demo: httpx.Client, register_synthetic: Callable[..., str],
    start_worker: Callable[..., Any], wait_jobs: Callable[..., list[dict[str, Any]]],
) -> None:
    model = register_synthetic("gauges")
    ids = [demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": f"t{i}"}}).json()["id"] for i in range(3)]
    bulk = demo.post(f"/v1/models/{model}/jobs:bulk", json={"inputs": [{"text": "b"}] * 2}).json()["ids"]
    time.sleep(0.3)
    queued = _gauges(anon, model)
    assert queued[("sluice_stream_lag", "online")] == 3 and queued[("sluice_stream_lag", "bulk")] == 2
    assert queued[("sluice_queue_pending", "online")] == 0
    assert queued[("sluice_queue_oldest_age_seconds", "online")] >= 0.2
    assert queued[("sluice_live_workers", "")] == 0

    start_worker(model)
    wait_jobs(demo, ids + bulk)
    wait_until(lambda: _gauges(anon, model)[("sluice_stream_lag", "online")] == 0, timeout_s=10,
               what="the lag to read 0")
    served = _gauges(anon, model)
    assert served[("sluice_stream_lag", "bulk")] == 0
    assert served[("sluice_queue_oldest_age_seconds", "online")] == 0
    assert served[("sluice_live_workers", "")] == 1
