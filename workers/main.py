"""`sluice worker`: one process serving one (model, version).

Start-up order matters for readiness: verify the artifact's sha256, load, warm up, and only
then join the consumer group, so no job is read by a worker that cannot run it yet.
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
from sluice.errors import EXIT_ARTIFACT_REFUSED, EXIT_WORKER_FAILED, ArtifactError, SluiceError, WorkerFailed
from sluice.metrics import COLD_START, INT8_SPEEDUP, WORKER_INT8, WORKER_STATE
from sluice.registry import catalog
from sluice.registry.store import Registry
from sluice.registry.tables import ModelVersion
from sluice.settings import Settings
from sluice.shutdown import install_two_stage
from sluice.wire.connections import connect

log = logging.getLogger(__name__)


def _load_version(registry: Registry, model: str, version: str) -> tuple[str, ModelVersion]:
    with registry.session() as session:
        row = catalog.get_version(session, model, version)
        kind = row.model_row.kind
        session.expunge(row)
        return kind, row


def run_worker(*, settings: Settings, model: str, version: str, threads: int | None = None,
               device: str = "auto") -> int:
    """Run until signalled; answer the process exit code."""
    if threads:
        # Before torch is imported: its OpenMP pool reads these at start.
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        os.environ.setdefault("MKL_NUM_THREADS", str(threads))
    from workers.models.loading import Sources, load_handler
    from workers.models.precision import PrecisionPolicy
    from workers.worker import Worker

    registry = Registry.serving(settings, pool_size=1)
    started = time.perf_counter()
    try:
        kind, row = _load_version(registry, model, version)
        handler = load_handler(kind=kind, artifact=row.artifact, sha256=row.sha256, device=device,
                               threads=threads, precision=PrecisionPolicy(
                                   min_speedup=settings.int8_min_speedup, rounds=settings.int8_calibration_rounds),
                               sources=Sources(handler=row.handler, input_schema=row.input_schema,
                                               output_schema=row.output_schema, cache_dir=settings.artifact_cache,
                                               ca_bundle=settings.artifact_ca_bundle,
                                               allow_pickle=row.allow_pickle))
        handler.warmup()
    except ArtifactError as exc:
        log.error("version %s/%s refused: %s", model, version, exc)
        try:
            with registry.session() as session:
                catalog.record_version_error(session, model=model, version=version, message=str(exc))
        except SluiceError:
            pass
        return EXIT_ARTIFACT_REFUSED
    finally:
        registry.dispose()
    cold_start_s = time.perf_counter() - started
    COLD_START.labels(model, version).set(cold_start_s)
    choice = handler.precision
    if choice is not None:
        WORKER_INT8.labels(model, version).set(1 if choice.precision == "int8" else 0)
        if choice.speedup is not None:
            INT8_SPEEDUP.labels(model, version).set(choice.speedup)
        log.info("worker for %s/%s runs %s: %s", model, version, choice.precision, choice.reason)
    endpoint = exposition.serve_metrics(host=settings.metrics_host, port=settings.metrics_port)
    target = exposition.ScrapeTarget(address=endpoint.address, process="worker")
    log.info("worker for %s/%s ready after %.2fs cold start (threads=%s), metrics on %s",
             model, version, cold_start_s, threads, endpoint.address)

    async def main() -> None:
        redis = connect(settings.require_redis_url(), max_connections=8)
        worker = Worker(
            redis=redis, model=model, version=version, handler=handler,
            max_batch_size=row.max_batch_size, max_wait_ms=row.max_wait_ms,
            isolate_tenants=row.isolate_tenants, result_ttl_s=settings.result_ttl_s,
            claim_after_s=settings.claim_after_s, max_deliveries=settings.max_deliveries,
            prefetch_batches=settings.worker_prefetch_batches, shutdown_grace_s=settings.shutdown_grace_s,
            cold_start_s=cold_start_s, precision=choice.precision if choice else "",
            int8_speedup=choice.speedup if choice else None, batch_timeout_s=settings.batch_timeout_s,
        )

        def leave_now() -> None:
            # Unacknowledged entries are reclaimed by another worker.
            log.warning("second signal: exiting without draining")
            os._exit(1)

        install_two_stage(worker.request_stop, force=leave_now, loop=asyncio.get_running_loop())
        WORKER_STATE.labels(model, version).set(1)
        advertising = asyncio.create_task(_advertise(redis, target))
        failed = False
        try:
            await worker.run()
        except WorkerFailed:
            log.exception("worker for %s/%s failed", model, version)
            failed = True
        finally:
            WORKER_STATE.labels(model, version).set(0)
            advertising.cancel()
            with contextlib.suppress(SluiceError):
                await exposition.withdraw_async(redis, target)
            await redis.aclose()
        if failed:
            # Now, not after the loop: closing it joins the model's thread, which may hang forever.
            logging.shutdown()
            os._exit(EXIT_WORKER_FAILED)

    run_event_loop(main())
    return 0


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
    sys.exit(run_worker(settings=Settings(), model=sys.argv[1], version=sys.argv[2]))
