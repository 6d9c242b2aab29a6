"""The Celery app: webhook delivery (workers/delivery.py) and batch scoring (workers/batches.py,
workers/schedules.py) run as tasks, watched by Flower.

    celery -A workers.tasks worker -B -P threads -Q sluice.webhooks   # deliveries, the relay, beat
    celery -A workers.tasks worker -P threads -Q sluice.batches -c 3   # batch feeders, schedules
    celery -A workers.tasks flower --port=5555

Deliveries and batch feeding have queues of their own (`task_routes`), and each queue a worker of
its own, so a feeder, which holds a thread for its whole batch, never takes a delivery's thread. A
worker started without `-Q` consumes both queues (one process for a small installation).

Importing this module reads no configuration. `app`'s configuration is a promise (Celery's
`add_defaults` with a callable) that builds `Settings()` from the `SLUICE_*` environment the first
time Celery needs a value: broker and result backend are the platform's Redis. The connections
(Redis, the registry, an HTTP client) are built on the first task. Tests and embedders build
their own app with `create_app(settings=...)`.

The threads pool suits delivery, which is all waiting on the network, and lets the threads share
one tenant-secret cache. Every worker also runs the outbox relay (workers/outbox.py) in a thread
of its own, from a bootstep: webhooks flow exactly when some Celery worker runs. Beat sends
`sweep_webhooks`, which re-sends deliveries whose next attempt is long overdue (their Celery
message was lost with a broker that lost its data, or their worker died mid-attempt), and nightly
`sluice.retune` (scheduler/retune_task.py), which re-plans the batching of every version with a p99
budget on the mix it served.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from celery import Celery, Task, bootsteps, signals
from celery.schedules import crontab
from kombu.exceptions import KombuError

from sluice import exposition
from sluice.errors import BrokerError, BrokerUnavailable
from sluice.logs import prepare_handler
from sluice.registry.batches import to_dispatch
from sluice.registry.store import Registry
from sluice.settings import Settings
from sluice.vocabulary import RETUNE_TASK
from sluice.wire.connections import connect, connect_sync
from workers.batches import BatchFeeder
from workers.delivery import Deliverer
from workers.outbox import OutboxRelay
from workers.schedules import dispatch_due

log = logging.getLogger(__name__)

DELIVER_TASK = "sluice.deliver_webhook"
SWEEP_TASK = "sluice.sweep_webhooks"
RUN_BATCH_TASK = "sluice.run_batch"
SWEEP_BATCHES_TASK = "sluice.sweep_batches"
# A queue per pool: webhook deliveries wait on receivers, batch feeders hold a thread per batch.
WEBHOOK_QUEUE = "sluice.webhooks"
BATCH_QUEUE = "sluice.batches"
ROUTES = {DELIVER_TASK: WEBHOOK_QUEUE, SWEEP_TASK: WEBHOOK_QUEUE, RUN_BATCH_TASK: BATCH_QUEUE,
          SWEEP_BATCHES_TASK: BATCH_QUEUE, RETUNE_TASK: BATCH_QUEUE}
# Modules a Celery worker imports at start for the tasks they register: the nightly re-tune runs
# the scheduler's simulator, which this package may not import (docs/ARCHITECTURE.md, "Tuning").
INCLUDE = ("scheduler.retune_task",)


def celery_config(settings: Settings) -> dict[str, Any]:
    url = settings.require_celery_broker_url()
    return {
        "broker_url": url,
        "result_backend": url,
        "broker_connection_retry_on_startup": True,
        # A message is acknowledged once its task has run, and the message of a worker that died
        # comes back after the visibility timeout, which outlasts the longest retry countdown
        # (a retry waits in its worker as an unacknowledged ETA message).
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "broker_transport_options": {"visibility_timeout": int(max(3600.0, 2 * settings.webhook_backoff_cap_s))},
        "worker_prefetch_multiplier": 1,
        # Every task on its pool's queue; a worker without -Q consumes all of them.
        "task_queues": {queue: {"exchange": queue, "routing_key": queue} for queue in (WEBHOOK_QUEUE, BATCH_QUEUE)},
        "task_default_queue": WEBHOOK_QUEUE,
        "task_routes": {task: {"queue": queue} for task, queue in ROUTES.items()},
        "worker_concurrency": settings.webhook_concurrency,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_expires": settings.result_ttl_s,
        # For Flower.
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        # One interval entry needs no schedule file: beat keeps it in memory.
        "beat_scheduler": "celery.beat:Scheduler",
        "beat_schedule": {
            "sluice-sweep-webhooks": {"task": SWEEP_TASK, "schedule": settings.webhook_sweep_s},
            # Due schedule slots, batches that need a feeder, batch callbacks; expires so that a
            # backlog of sweeps left while no worker ran is not worked through one by one.
            "sluice-sweep-batches": {"task": SWEEP_BATCHES_TASK, "schedule": settings.batch_sweep_s,
                                     "options": {"expires": max(1.0, settings.batch_sweep_s)}},
            # Nightly; a run missed while no worker ran is not worth doing hours late, twice.
            "sluice-retune": {"task": RETUNE_TASK, "schedule": crontab(minute=0, hour=settings.retune_hour_utc),
                              "options": {"expires": 3600.0}},
        },
        "include": list(INCLUDE),
        "timezone": "UTC",
        "enable_utc": True,
    }


class _Runtime:
    """The settings, the per-process Deliverer and BatchFeeder, built on first use."""

    def __init__(self, settings: Settings | None) -> None:
        self._settings = settings
        self._deliverer: Deliverer | None = None
        self._feeder: BatchFeeder | None = None
        self._feeding: threading.BoundedSemaphore | None = None
        self._lock = threading.Lock()

    @property
    def settings(self) -> Settings:
        with self._lock:
            if self._settings is None:
                self._settings = Settings()
            return self._settings

    def deliverer(self) -> Deliverer:
        settings = self.settings
        with self._lock:
            if self._deliverer is None:
                self._deliverer = Deliverer.from_settings(settings)
            return self._deliverer

    def feeding(self) -> threading.BoundedSemaphore:
        """The process's feeder slots."""
        settings = self.settings
        with self._lock:
            if self._feeding is None:
                self._feeding = threading.BoundedSemaphore(settings.batch_feeders_per_worker)
            return self._feeding

    def feeder(self) -> BatchFeeder:
        settings = self.settings
        with self._lock:
            if self._feeder is None:
                self._feeder = BatchFeeder(
                    redis=connect_sync(settings.require_redis_url(), socket_timeout_s=10.0,
                                       health_check_interval=15),
                    registry=Registry.serving(settings, pool_size=4),
                    storage=settings.batch_storage, batch_root=settings.batch_root,
                    max_in_flight=settings.batch_max_in_flight, max_running=settings.batch_max_running,
                    lease_s=settings.batch_lease_s, checkpoint_s=settings.batch_checkpoint_s,
                    max_line_bytes=settings.batch_max_line_bytes,
                    result_ttl_s=settings.result_ttl_s, max_text_chars=settings.max_text_chars,
                )
            return self._feeder

    def stop_feeding(self) -> None:
        with self._lock:
            if self._feeder is not None:
                self._feeder.request_stop()

    def close(self) -> None:
        with self._lock:
            if self._deliverer is not None:
                self._deliverer.close()
                self._deliverer = None
            if self._feeder is not None:
                self._feeder.close()
                self._feeder = None


def _relay_step(runtime: _Runtime, publish: Callable[[str, str], None]) -> type[bootsteps.StartStopStep]:
    class OutboxRelayStep(bootsteps.StartStopStep):
        """The outbox relay, on a thread of the worker's main process, with its own event loop."""

        # After the pool: a prefork pool forks its children before the relay thread exists.
        requires = {"celery.worker.components:Pool"}

        def __init__(self, parent: Any, **kwargs: Any) -> None:
            super().__init__(parent, **kwargs)
            self.relay: OutboxRelay | None = None
            self.thread: threading.Thread | None = None

        def start(self, parent: Any) -> None:
            settings = runtime.settings
            client = connect(settings.require_redis_url(), max_connections=4)
            relay = OutboxRelay(redis=client, publish=publish, claim_after_s=settings.claim_after_s)

            async def serve() -> None:
                try:
                    await relay.run()
                finally:
                    await client.aclose()

            self.relay = relay
            self.thread = threading.Thread(target=asyncio.run, args=(serve(),), name="sluice-outbox-relay",
                                           daemon=True)
            self.thread.start()
            log.info("outbox relay %s started", relay.name)

        def stop(self, parent: Any) -> None:
            if self.relay is not None and self.thread is not None:
                self.relay.request_stop()
                self.thread.join(timeout=10)

    return OutboxRelayStep


def _metrics_step(runtime: _Runtime) -> type[bootsteps.StartStopStep]:
    class MetricsStep(bootsteps.StartStopStep):
        """This worker's metrics (webhook attempts, batch feeders) on a port of its own, advertised
        for discovery (sluice.exposition). With the threads pool every task runs in this process,
        so one registry sees them all."""

        def __init__(self, parent: Any, **kwargs: Any) -> None:
            super().__init__(parent, **kwargs)
            self.stopping = threading.Event()
            self.thread: threading.Thread | None = None

        def start(self, parent: Any) -> None:
            settings = runtime.settings
            endpoint = exposition.serve_metrics(host=settings.metrics_host, port=settings.metrics_port)
            target = exposition.ScrapeTarget(address=endpoint.address, process="celery")
            client = connect_sync(settings.require_redis_url())

            def advertise() -> None:
                try:
                    while not self.stopping.is_set():
                        with contextlib.suppress(BrokerError):
                            exposition.advertise(client, target, now=time.time())
                        self.stopping.wait(exposition.ADVERTISE_EVERY_S)
                    with contextlib.suppress(BrokerError):
                        exposition.withdraw(client, target)
                finally:
                    client.close()

            self.thread = threading.Thread(target=advertise, name="sluice-metrics-advertiser", daemon=True)
            self.thread.start()
            log.info("metrics on %s", endpoint.address)

        def stop(self, parent: Any) -> None:
            self.stopping.set()
            if self.thread is not None:
                self.thread.join(timeout=5)

    return MetricsStep


def create_app(*, settings: Settings | None = None) -> Celery:
    """The Celery app over `settings` (read from the environment on first use when None)."""
    runtime = _Runtime(settings)
    app = Celery("sluice", set_as_current=False)
    app.add_defaults(lambda: celery_config(runtime.settings))

    @app.task(bind=True, name=DELIVER_TASK, max_retries=None)
    def deliver_webhook(self: Task, delivery_id: str, job_id: str) -> dict[str, Any]:
        """One attempt at one webhook delivery; the task id is the delivery id."""
        try:
            result = runtime.deliverer().attempt(delivery_id, job_id)
        except BrokerError as exc:
            # Redis is unreachable: nothing was attempted or counted; try again shortly.
            raise self.retry(exc=exc, countdown=5.0) from exc
        if result.outcome in {"retry", "deferred"}:
            # A deferred attempt waits in the broker, not in a thread of the pool.
            raise self.retry(countdown=result.retry_in_s)
        return {"outcome": result.outcome, "attempt": result.number, "detail": result.detail}

    def publish(delivery_id: str, job_id: str) -> None:
        try:
            deliver_webhook.apply_async((delivery_id, job_id), task_id=delivery_id)
        except (KombuError, OSError) as exc:
            raise BrokerUnavailable(f"could not queue webhook {delivery_id}: {exc}") from exc

    @app.task(name=SWEEP_TASK, ignore_result=True)
    def sweep_webhooks() -> int:
        """Re-send deliveries whose next attempt is overdue by more than a sweep interval."""
        overdue = runtime.deliverer().overdue(grace_s=runtime.settings.webhook_sweep_s)
        for delivery_id, job_id in overdue:
            publish(delivery_id, job_id)
        if overdue:
            log.warning("re-sent %d overdue webhook deliveries", len(overdue))
        return len(overdue)

    @app.task(name=RUN_BATCH_TASK, ignore_result=True)
    def run_batch(batch_id: str) -> str:
        """Feed one batch to its end (or until this worker stops: the next sweep re-sends it)."""
        slots = runtime.feeding()
        if not slots.acquire(blocking=False):
            # Every feeder slot of this process is taken: the sweep sends it again, to any worker.
            return "busy"
        try:
            return runtime.feeder().run(batch_id)
        finally:
            slots.release()

    @app.task(name=SWEEP_BATCHES_TASK, ignore_result=True)
    def sweep_batches() -> dict[str, int]:
        """Create the batches of due schedule slots, send every batch that needs a feeder, and
        queue the callbacks of finished batches."""
        feeder = runtime.feeder()
        scheduled = dispatch_due(feeder.registry, batch_root=feeder.batch_root, now=datetime.now(UTC))
        with feeder.registry.session() as session:
            waiting = to_dispatch(session, now=datetime.now(UTC), lease_s=feeder.lease_s)
        for batch_id in waiting:
            try:
                run_batch.apply_async((batch_id,))
            except (KombuError, OSError) as exc:
                raise BrokerUnavailable(f"could not queue batch {batch_id}: {exc}") from exc
        return {"scheduled": len(scheduled), "sent": len(waiting), "callbacks": feeder.send_callbacks()}

    app.steps["worker"].add(_relay_step(runtime, publish))
    app.steps["worker"].add(_metrics_step(runtime))

    @signals.worker_shutting_down.connect(weak=False)
    def _stop_feeding(**_: Any) -> None:
        # Celery's warm shutdown waits for running tasks: a feeder stops at its next checkpoint
        # and hands its batch back rather than holding the worker for the rest of the batch.
        runtime.stop_feeding()

    @signals.worker_shutdown.connect(weak=False)
    def _close(**_: Any) -> None:
        # Sent once every step has stopped, so no delivery is still using the connections.
        runtime.close()

    return app


@signals.after_setup_logger.connect(weak=False, dispatch_uid="sluice-redact-celery")
@signals.after_setup_task_logger.connect(weak=False, dispatch_uid="sluice-redact-celery-tasks")
def _sluice_celery_logs(logger: logging.Logger, **_: Any) -> None:
    """Celery installs its own log handlers: give them the format and redaction of every Sluice process."""
    fmt = Settings().log_format
    for handler in logger.handlers:
        prepare_handler(handler, fmt=fmt, process="celery")


app = create_app()
