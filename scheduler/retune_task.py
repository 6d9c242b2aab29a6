"""The nightly re-tune (scheduler/retune.py) as a Celery task.

Beat sends `sluice.retune` (workers/tasks.py) on the batch queue; the Celery app names this module
in its `include`, so a Celery worker imports it at start and the task is registered on that app
(`shared_task`) without `workers` importing the scheduler. The task reads its settings from the
`SLUICE_*` environment, as the Celery app does, and runs once at a time per worker process.
The re-tune itself (the simulator, numpy) is imported when the task first runs: every Celery
process imports this module, and only the batch worker runs the task, nightly.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import asdict
from typing import Any

from celery import shared_task

from sluice.registry.store import Registry
from sluice.settings import Settings
from sluice.vocabulary import RETUNE_TASK
from sluice.wire.connections import connect

_running = threading.Lock()


@shared_task(name=RETUNE_TASK, ignore_result=True)  # type: ignore[untyped-decorator]
def retune() -> list[dict[str, Any]]:
    if not _running.acquire(blocking=False):
        return []
    try:
        from scheduler.planning.retune import Grid
        from scheduler.retune import retune_all

        settings = Settings()
        registry = Registry.serving(settings, pool_size=1)

        async def run() -> list[dict[str, Any]]:
            redis = connect(settings.require_redis_url(), max_connections=2)
            try:
                outcomes = await retune_all(registry=registry, redis=redis, min_gain=settings.retune_min_gain,
                                            batch_timeout_s=settings.batch_timeout_s, clock=time.time,
                                            grid=Grid(adaptive_wait=settings.batch_adaptive_wait))
            finally:
                await redis.aclose()
            return [asdict(outcome) for outcome in outcomes]

        try:
            return asyncio.run(run())
        finally:
            registry.dispose()
    finally:
        _running.release()
