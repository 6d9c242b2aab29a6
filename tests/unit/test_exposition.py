"""Where each process's metrics are found: its endpoint, its advertisement, the file-SD file."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import redis

from sluice import exposition
from sluice.exposition import ScrapeTarget
from sluice.metrics import WEBHOOK_ATTEMPTS


def test_file_sd_lists_every_target_once_in_a_stable_order() -> None:
    targets = [ScrapeTarget("127.0.0.1:41000", "worker"), ScrapeTarget("127.0.0.1:8000", "api"),
               ScrapeTarget("127.0.0.1:40000", "worker")]
    assert exposition.file_sd(targets) == [
        {"targets": ["127.0.0.1:8000"], "labels": {"process": "api"}},
        {"targets": ["127.0.0.1:40000"], "labels": {"process": "worker"}},
        {"targets": ["127.0.0.1:41000"], "labels": {"process": "worker"}},
    ]


def test_the_file_is_replaced_whole(tmp_path: Path) -> None:
    path = tmp_path / "prometheus" / "targets.json"
    exposition.write_file_sd(path, [ScrapeTarget("127.0.0.1:1", "api")])
    exposition.write_file_sd(path, [ScrapeTarget("127.0.0.1:2", "scheduler")])
    assert json.loads(path.read_text()) == [{"targets": ["127.0.0.1:2"], "labels": {"process": "scheduler"}}]
    assert [p.name for p in path.parent.iterdir()] == ["targets.json"]


def test_a_wildcard_bind_is_advertised_under_the_host_name() -> None:
    assert exposition.MetricsEndpoint("127.0.0.1", 9100).address == "127.0.0.1:9100"
    assert exposition.MetricsEndpoint("0.0.0.0", 9100).address.endswith(":9100")
    assert not exposition.MetricsEndpoint("0.0.0.0", 9100).address.startswith("0.0.0.0")
    assert exposition.MetricsEndpoint("::1", 9100).address == "[::1]:9100"


def test_an_ephemeral_endpoint_serves_this_process_and_is_advertised_until_withdrawn(redis_url: str) -> None:
    endpoint = exposition.serve_metrics(host="127.0.0.1", port=0)
    assert endpoint.port > 0
    WEBHOOK_ATTEMPTS.labels("delivered").inc()
    body = httpx.get(f"http://{endpoint.address}/metrics", timeout=5).text
    assert 'sluice_webhook_attempts_total{outcome="delivered"}' in body

    client = redis.Redis.from_url(redis_url)
    target = ScrapeTarget(endpoint.address, "celery")
    try:
        exposition.advertise(client, target, now=1000.0)
        assert target in exposition.live_targets(client, now=1000.0 + exposition.LIVE_WITHIN_S - 1)
        assert target not in exposition.live_targets(client, now=1000.0 + exposition.LIVE_WITHIN_S + 1)
        exposition.advertise(client, target, now=2000.0)
        exposition.withdraw(client, target)
        assert target not in exposition.live_targets(client, now=2000.0)
    finally:
        client.close()
