"""The FastAPI application: wiring only. Routes live in api/routes, state in api/deps."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis.asyncio as aioredis
from fastapi import FastAPI

from api import errors
from api.admission import Admission
from api.breakers import BreakerBoard
from api.caches import AuthCache, RoutingCache, registry_lookup
from api.deps import AppState
from api.event_hub import EventHub
from api.middleware import BodyLimitMiddleware, MetricsMiddleware, RequestIdMiddleware, StrictJsonMiddleware
from api.placement_view import PlacementView
from api.routes import batches, dashboard, health, jobs, models, rollouts, schedules, tenants, waits
from sluice.breaker import CircuitBreaker
from sluice.metrics import PRICE_PER_CORE_HOUR, PRICE_PER_GPU_HOUR
from sluice.registry.store import Registry
from sluice.settings import Settings
from sluice.tenant_objects import ObjectStore
from sluice.wire import events
from sluice.wire.broker import Broker
from sluice.wire.connections import connect
from sluice.wire.durability import require_durable_store

log = logging.getLogger(__name__)

# How long shutdown waits for the background tasks it cancelled.
TASK_STOP_S = 5.0


def create_app(
    *, settings: Settings, redis: aioredis.Redis | None = None, registry: Registry | None = None
) -> FastAPI:
    """Build the app. Connections may be passed in (tests, embedders); otherwise they come from
    the settings' URLs and are closed on shutdown."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        own_redis = redis is None
        own_registry = registry is None
        # Grafana's cost per 1,000 jobs multiplies the workers' core- and GPU-seconds by these.
        PRICE_PER_CORE_HOUR.set(settings.price_per_core_hour)
        PRICE_PER_GPU_HOUR.set(settings.price_per_gpu_hour)
        client = redis or connect(settings.require_redis_url())
        durable_ms = settings.durable_accept_timeout_ms if settings.durable_accept else None
        if durable_ms is not None:
            try:
                await require_durable_store(client, timeout_ms=durable_ms)
            except BaseException:
                if own_redis:
                    await client.aclose()
                raise
        reg = registry or Registry.serving(settings, pool_size=5)
        routing = RoutingCache(registry=reg, refresh_s=settings.routing_refresh_s)
        auth = AuthCache(lookup=registry_lookup(reg), ttl_s=settings.auth_cache_s)

        def on_control(event: events.Event) -> None:
            if isinstance(event, events.RoutingChanged):
                routing.request_reload()
            elif isinstance(event, events.KeyRevoked):
                auth.forget(event.key_hash)
            elif isinstance(event, events.Resync):
                auth.forget()
                routing.request_reload()

        hub = EventHub(redis=client, on_control=on_control)
        breakers = BreakerBoard(redis=client, routing=routing, make_breaker=lambda: CircuitBreaker(
            error_rate=settings.breaker_error_rate, min_samples=settings.breaker_min_samples,
            window_s=settings.breaker_window_s, no_worker_grace_s=settings.breaker_no_worker_grace_s,
            open_s=settings.breaker_open_s,
        ))
        broker = Broker(redis=client, result_ttl_s=settings.result_ttl_s,
                        idempotency_ttl_s=settings.idempotency_ttl_s, durable_timeout_ms=durable_ms)
        state = AppState(settings=settings, broker=broker, registry=reg, routing=routing, auth=auth, hub=hub,
                         admission=Admission(
                             redis=client, broker=broker, max_answered_jobs=settings.max_answered_jobs,
                             cache_hit_token_cost=settings.cache_hit_token_cost, fair_share=settings.fair_share),
                         breakers=breakers, placement=PlacementView(redis=client),
                         objects=ObjectStore.from_settings(settings))
        app.state.sluice = state
        await routing.reload()
        tasks = [asyncio.create_task(hub.run(), name="events"),
                 asyncio.create_task(routing.refresh_forever(), name="routing-reload"),
                 asyncio.create_task(breakers.run_forever(), name="breakers"),
                 asyncio.create_task(state.placement.run_forever(), name="placement")]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            # Bounded: a task stuck in a Redis client's cleanup must not hold the shutdown forever.
            stopped, stuck = await asyncio.wait(tasks, timeout=TASK_STOP_S)
            for task in stopped:
                if not task.cancelled() and task.exception() is not None:
                    log.warning("background task %s had failed: %s", task.get_name(), task.exception())
            for task in stuck:
                log.warning("background task %s did not stop within %.0fs", task.get_name(), TASK_STOP_S)
            if own_redis:
                await client.aclose()
            if own_registry:
                reg.dispose()

    app = FastAPI(
        title="Sluice",
        version="1",
        summary="Asynchronous inference: submit jobs, collect results by polling, SSE or webhook.",
        lifespan=lifespan,
        # FastAPI's own OpenTelemetry spans and metrics: nothing here configures a provider, yet
        # with them on every request asked OpenTelemetry whether one was (2-3 % of a job read's CPU).
        telemetry={"tracing": False, "metrics": False},
    )
    errors.install(app)
    for module in (health, jobs, waits, models, rollouts, tenants, batches, schedules, dashboard):
        app.include_router(module.router)
    # The last added runs first: metrics see every answer, and the JSON check reads bounded bodies.
    app.add_middleware(StrictJsonMiddleware)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes, upload_paths=frozenset({"/v1/batches"}),
                       max_upload_bytes=settings.max_batch_upload_bytes)
    app.add_middleware(MetricsMiddleware)
    app.add_middleware(RequestIdMiddleware)
    return app
