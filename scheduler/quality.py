"""Folds the per-job samples of every live version into per-window quality aggregates.

Workers append one sample per finished job to the version's Redis stream (latency, batch facts
and the quality proxies of `sluice.quality`); the stream is trimmed, so history that operators
compare across days lives in Postgres, one row per version per closed window.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

import redis.asyncio as aioredis

from sluice.errors import SluiceError
from sluice.registry import quality, routing_table
from sluice.registry.store import Registry
from sluice.stats import summarise
from sluice.versions import VersionState
from sluice.wire.connections import connect
from sluice.wire.samples import read_samples

log = logging.getLogger(__name__)


class QualityAggregator:
    def __init__(self, *, registry: Registry, redis: aioredis.Redis, window_s: int = 60,
                 clock: Callable[[], float] = time.time) -> None:
        self.registry = registry
        self.redis = redis
        self.window_s = window_s
        self.clock = clock

    async def flush(self) -> int:
        """Store the last closed window of every non-retired version; answer the rows written."""
        end = (self.clock() // self.window_s) * self.window_s
        start = end - self.window_s
        with self.registry.session() as session:
            snapshot = routing_table.routing_snapshot(session)
        written = 0
        for model in snapshot.models.values():
            for version in model.versions.values():
                if version.state == VersionState.retired:
                    continue
                samples = [s for s in await read_samples(self.redis, model.name, version.version,
                                                         window_s=self.window_s, now=end)
                           if start <= s.finished_at < end]
                if not samples:
                    continue
                summary = summarise(samples, window_s=self.window_s)
                metrics = {name: summary[name] for name in
                           ("error_rate", "queue_wait_ms", "model_ms", "total_ms", "batch_size", "quality")}
                with self.registry.session() as session:
                    written += quality.record_window(
                        session, model=model.name, version=version.version, window_start=start,
                        window_s=self.window_s, count=summary["count"], errors=summary["errors"],
                        metrics=metrics,
                    )
        return written


def run_aggregator(*, registry: Registry, redis_url: str, stopping: threading.Event, window_s: int = 60) -> None:
    """Thread body for the scheduler process: flush each window shortly after it closes."""

    async def main() -> None:
        client = connect(redis_url, max_connections=2)
        aggregator = QualityAggregator(registry=registry, redis=client, window_s=window_s)
        try:
            while not stopping.is_set():
                try:
                    await aggregator.flush()
                except SluiceError as exc:
                    log.warning("quality aggregation skipped this window: %s", exc)
                # A little after the next window closes, so late samples of it are in.
                wait = window_s - (time.time() % window_s) + 2.0
                await asyncio.to_thread(stopping.wait, wait)
        finally:
            await client.aclose()

    asyncio.run(main())
