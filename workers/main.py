"""`sluice worker`: one process serving the versions of its placement group (`--group`), or one
fixed version (`--model --version`, for compose files and tests that want a worker of their own).

Start-up order matters for readiness: each version's artifact is verified, loaded and warmed
before its Worker joins the consumer group, so no job is read by a worker that cannot run it yet
(workers/host.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from collections.abc import Coroutine
from typing import Any

import redis.asyncio as aioredis
import uvloop

from sluice import exposition
from sluice.errors import EXIT_ARTIFACT_REFUSED, EXIT_WORKER_FAILED, SluiceError
from sluice.registry.store import Registry
from sluice.settings import Settings
from sluice.shutdown import install_two_stage
from sluice.wire.connections import connect

log = logging.getLogger(__name__)


def run_worker(*, settings: Settings, model: str | None = None, version: str | None = None,
               group: str | None = None, threads: int | None = None, device: str = "auto") -> int:
    """Run until signalled; answer the process exit code."""
    if threads:
        # Before torch is imported: its OpenMP pool reads these at start.
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        os.environ.setdefault("MKL_NUM_THREADS", str(threads))
    from workers.host import ArtifactRefusedAtStart, WorkerHost
    from workers.models.shared import LoadedModels
    from workers.slots import ExecutionSlots

    fixed = {(model, version): ""} if model is not None and version is not None else None
    endpoint = exposition.serve_metrics(host=settings.metrics_host, port=settings.metrics_port)
    target = exposition.ScrapeTarget(address=endpoint.address, process="worker")
    log.info("worker process for %s (threads=%s), metrics on %s",
             f"group {group}" if group else f"{model}/{version}", threads, endpoint.address)
    registry = Registry.serving(settings, pool_size=1)
    code = 0

    async def main() -> None:
        nonlocal code
        # Each version's Worker holds a blocking read, a heartbeat, a refresh and its writes at once.
        redis = connect(settings.require_redis_url(), max_connections=64)
        host = WorkerHost(redis=redis, registry=registry, settings=settings, models=LoadedModels(),
                          slots=ExecutionSlots(slots=1), group=group, fixed=fixed, device=device, threads=threads)

        def leave_now() -> None:
            # Unacknowledged entries are reclaimed by another worker.
            log.warning("second signal: exiting without draining")
            os._exit(1)

        install_two_stage(host.request_stop, force=leave_now, loop=asyncio.get_running_loop())
        advertising = asyncio.create_task(_advertise(redis, target))
        try:
            await host.run()
        except ArtifactRefusedAtStart:
            code = EXIT_ARTIFACT_REFUSED
        except SluiceError:
            log.exception("worker process failed")
            code = EXIT_WORKER_FAILED
        finally:
            advertising.cancel()
            with contextlib.suppress(SluiceError):
                await exposition.withdraw_async(redis, target)
            await redis.aclose()
        if code == EXIT_WORKER_FAILED:
            # Now, not after the loop: closing it joins the model's thread, which may hang forever.
            logging.shutdown()
            os._exit(EXIT_WORKER_FAILED)

    try:
        run_event_loop(main())
    finally:
        registry.dispose()
    return code


async def _advertise(redis: aioredis.Redis, target: exposition.ScrapeTarget) -> None:
    while True:
        with contextlib.suppress(SluiceError):
            await exposition.advertise_async(redis, target, now=time.time())
        await asyncio.sleep(exposition.ADVERTISE_EVERY_S)


def run_event_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run a worker's coroutine on uvloop: per batch the loop hands the model a thread and waits
    on a few Redis round trips, which cost about 6 % less CPU there than on asyncio's loop
    (bench/worker_cost.py, single jobs)."""
    uvloop.run(main)


if __name__ == "__main__":  # pragma: no cover - `sluice worker` is the entry point
    sys.exit(run_worker(settings=Settings(), group=sys.argv[1]))
