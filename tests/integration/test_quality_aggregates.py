"""Per-window quality aggregates: samples in Redis folded into one Postgres row per window."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import redis

from scheduler.quality import QualityAggregator
from sluice.registry import quality
from sluice.registry.store import Registry
from sluice.wire import connections, keys

WINDOW_S = 60
NOW = 1_900_000_050.0  # 30 s into a window; the closed one starts at 1_899_999_960


def _sample(rds: redis.Redis, model: str, at: float, *, ok: bool, label: str, top_p: float) -> None:
    rds.xadd(keys.stats(model, "v1"), {
        "s": "succeeded" if ok else "failed", "t": repr(at), "qw": "5.0", "m": "2.0", "tt": "9.0", "b": "4",
        "r": "size", "q": json.dumps({"size": 50, "label": label, "top_p": top_p}),
    }, id=f"{int(at * 1000)}-*")


def test_a_closed_window_is_stored_once_with_its_quality_proxies(
    registry: Registry, rds: redis.Redis, redis_url: str, register_synthetic: Callable[..., str],
) -> None:
    model = register_synthetic("quality")
    closed_start = NOW - 30 - WINDOW_S
    _sample(rds, model, closed_start - 5, ok=True, label="old", top_p=0.1)  # the window before
    for i in range(8):
        _sample(rds, model, closed_start + 1 + i, ok=i != 0, label="a" if i < 6 else "b", top_p=0.9)
    _sample(rds, model, NOW - 10, ok=True, label="open", top_p=0.1)  # the window still open

    async def flush_twice() -> tuple[int, int]:
        client = connections.connect(redis_url)
        try:
            aggregator = QualityAggregator(registry=registry, redis=client, window_s=WINDOW_S, clock=lambda: NOW)
            return await aggregator.flush(), await aggregator.flush()
        finally:
            await client.aclose()

    first, second = asyncio.run(flush_twice())
    assert (first, second) == (1, 0)
    with registry.session() as session:
        rows = quality.windows(session, model=model, version="v1", since=0)
    assert len(rows) == 1
    row = rows[0]
    assert (row["count"], row["errors"], row["window_s"]) == (8, 1, WINDOW_S)
    assert row["metrics"]["quality"]["label_counts"] == {"a": 6, "b": 2}
    assert row["metrics"]["quality"]["mean_top_p"] == 0.9
    assert row["metrics"]["error_rate"] == 0.125
