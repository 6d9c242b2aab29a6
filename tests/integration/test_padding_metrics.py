"""The padding a real worker reports on `/metrics` is the padding `bench.inprocess` computes for the
same batch plan on the same skewed mix, within 10 %: arrival-order batches run as one padded pass
each (bench plan `arrival`), and the worker's own length-aware way, arrival-order batches that the
MiniLM encoder splits into passes by length (bench plan `chunked`).

The worker runs MiniLM in this process, so the API (also in process) serves its series on
`/metrics`. Every job is queued before its worker starts, so the worker's batches are the bench's
arrival-order chunks whatever the machine's speed. Several minutes on 2 cores: behind `soak`.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from scheduler.planning.text_mix import skewed_texts
from sluice.wire.connections import connect

pytestmark = [pytest.mark.soak, pytest.mark.model, pytest.mark.slow]

TEXTS = 256
BATCH = 32
# Larger than any pass: with it as the pass overhead the encoder never splits a batch.
ONE_PASS = 1 << 30
# A fixed pass overhead (tokens) for the length-aware run, so its plan does not depend on a timing.
OVERHEAD_TOKENS = 64
WORKER_TIMEOUT_S = 900


def tokens_on_metrics(anon: httpx.Client, model: str, version: str) -> tuple[float, float]:
    found = {"sluice_padded_tokens": 0.0, "sluice_real_tokens": 0.0}
    for family in text_string_to_metric_families(anon.get("/metrics").text):
        if family.name in found:
            found[family.name] = sum(s.value for s in family.samples if s.name.endswith("_total")
                                     and s.labels.get("model") == model and s.labels.get("version") == version)
    return found["sluice_padded_tokens"], found["sluice_real_tokens"]


async def run_until_done(redis_url: str, model: str, version: str, handler: Any, count: int) -> None:
    from workers.worker import Worker

    redis = connect(redis_url)
    worker = Worker(redis=redis, model=model, version=version, handler=handler, max_batch_size=BATCH,
                    max_wait_ms=10.0, isolate_tenants=False, prefetch_batches=TEXTS // BATCH, cores=1.0)
    running = asyncio.create_task(worker.run())
    for _ in range(WORKER_TIMEOUT_S * 5):
        if worker.processed >= count or running.done():
            break
        await asyncio.sleep(0.2)
    worker.request_stop()
    await running
    await redis.aclose()
    assert worker.processed == count


def test_the_padding_on_metrics_matches_bench_inprocess(
    anon: httpx.Client, admin: httpx.Client, demo: httpx.Client, redis_url: str,
    register_synthetic: Callable[..., str], wait_jobs: Callable[..., list[dict[str, Any]]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    from bench.inprocess import load_encoder, plan_padding
    from workers.models.minilm import DEFAULT_MAX_BATCH_TOKENS
    from workers.models.text_handlers import EmbeddingHandler

    encoder = load_encoder(1)
    texts = skewed_texts(TEXTS, seed=7)
    # The versions only route the jobs: the worker below runs MiniLM on them whatever the registry says.
    model = register_synthetic("padding", versions=("arrival", "aware"), max_batch_size=BATCH)
    runs = {"arrival": (ONE_PASS, ONE_PASS, "arrival"),
            "aware": (DEFAULT_MAX_BATCH_TOKENS, OVERHEAD_TOKENS, "chunked")}
    figures = {}
    for version, (max_batch_tokens, overhead, plan) in runs.items():
        encoder.max_batch_tokens, encoder.pass_overhead_tokens = max_batch_tokens, overhead
        response = demo.post(f"/v1/models/{model}/jobs:bulk",
                             json={"inputs": [{"text": t} for t in texts], "version": version})
        assert response.status_code == 202, response.text
        asyncio.run(run_until_done(redis_url, model, version, EmbeddingHandler(encoder=encoder), TEXTS))
        jobs = wait_jobs(demo, response.json()["ids"])
        assert {job["status"] for job in jobs} == {"succeeded"}
        padded, real = tokens_on_metrics(anon, model, version)
        assert real == sum(encoder.token_lengths(texts))
        bench = plan_padding(encoder, texts, plan, BATCH)
        stats = admin.get(f"/v1/models/{model}/versions/{version}/stats").json()["cost"]
        figures[version] = (padded / real, bench, stats["padding_ratio"])
        assert padded / real == pytest.approx(bench, rel=0.10), figures
        assert stats["padding_ratio"] == pytest.approx(padded / real, rel=1e-3), figures
    with capsys.disabled():
        for version, (worker, bench, stats) in figures.items():
            sys.stdout.write(f"\npadding, {version}: /metrics {worker:.3f}, bench.inprocess {bench:.3f}, "
                             f"/stats {stats}")
    # The skewed mix is what length-aware batching is for: far less padding than arrival order.
    assert figures["aware"][0] < figures["arrival"][0] / 2, figures
