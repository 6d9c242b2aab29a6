"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Annotated, Any

from anyio import to_thread
from fastapi import APIRouter, Depends, Response
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from api.deps import AppState, StateDep
from api.queue_gauges import refresh_queue_gauges
from sluice import exposition
from sluice.errors import ApiError, SluiceError

log = logging.getLogger(__name__)

router = APIRouter(tags=["health"])

_bearer = HTTPBearer(auto_error=False, description="Optional: an admin key also gets why a check failed")


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


def _why(exc: BaseException, timeout_s: float) -> str:
    return str(exc) if isinstance(exc, SluiceError) else f"no answer within {timeout_s:g} s"


async def _is_admin(state: AppState, credentials: HTTPAuthorizationCredentials | None) -> bool:
    """Whether the caller showed an admin key; anything else, a registry that cannot check the key
    included, makes it an anonymous caller (a probe is never refused for its key)."""
    if credentials is None or not credentials.credentials:
        return False
    try:
        key = await state.auth.authenticate(credentials.credentials)
    except ApiError:
        return False
    return key.is_admin


@router.get("/readyz")
async def readyz(
    state: StateDep, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> JSONResponse:
    """Ready means jobs can be accepted: Redis answers and a routing table is loaded.

    Postgres down is `degraded`, not unready: submissions go on against the cached table. Each
    dependency is `ok` or `unavailable`: the driver's message (hosts, ports, database and user
    names) goes only to a caller with an admin key, under `detail`.
    """
    checks: dict[str, Any] = {}
    detail: dict[str, str] = {}
    try:
        await asyncio.wait_for(state.broker.ping(), timeout=2.0)
        checks["redis"] = "ok"
    except (SluiceError, TimeoutError) as exc:
        checks["redis"] = "unavailable"
        detail["redis"] = _why(exc, 2.0)
    try:
        await asyncio.wait_for(to_thread.run_sync(state.registry.ping), timeout=3.0)
        checks["postgres"] = "ok"
    except (SluiceError, TimeoutError) as exc:
        checks["postgres"] = "unavailable"
        detail["postgres"] = _why(exc, 3.0)
    checks["routing"] = (
        "not loaded" if not state.routing.loaded else ("stale" if state.routing.degraded else "ok")
    )
    if state.routing.degraded:
        detail["routing"] = state.routing.degraded
    checks["events"] = "ok" if state.hub.connected.is_set() else "unavailable"
    if state.draining.is_set():
        return JSONResponse({"status": "draining", "checks": checks}, status_code=503)
    ready = checks["redis"] == "ok" and state.routing.loaded
    status = "ok" if ready and all(v == "ok" for v in checks.values()) else ("degraded" if ready else "unready")
    body: dict[str, Any] = {"status": status, "checks": checks, "breakers": state.breakers.states()}
    if detail and await _is_admin(state, credentials):
        body["detail"] = detail
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/metrics/targets", include_in_schema=False)
async def metrics_targets(state: StateDep) -> JSONResponse:
    """Prometheus HTTP service discovery: every live process that advertises its metrics endpoint
    (workers, the scheduler, the Celery worker), in the file-SD form `sluice up` writes. Open like
    `/metrics`: it names internal addresses, never user data."""
    return JSONResponse(exposition.file_sd(await exposition.live_targets_async(state.broker.redis, now=time.time())))


@router.get("/metrics", include_in_schema=False)
async def metrics(state: StateDep) -> Response:
    try:
        await refresh_queue_gauges(state.broker.redis, state.routing.current(), now=time.time())
    except SluiceError as exc:
        # The process's own metrics are still worth a scrape while Redis is away.
        log.warning("queue gauges not refreshed: %s", exc)
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
