"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import asyncio
from typing import Any

from anyio import to_thread
from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from api.deps import StateDep
from sluice.errors import SluiceError

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(state: StateDep) -> JSONResponse:
    """Ready means jobs can be accepted: Redis answers and a routing table is loaded.

    Postgres down is `degraded`, not unready: submissions go on against the cached table.
    """
    checks: dict[str, Any] = {}
    try:
        await asyncio.wait_for(state.broker.ping(), timeout=2.0)
        checks["redis"] = "ok"
    except (SluiceError, TimeoutError) as exc:
        checks["redis"] = f"down: {exc}"
    try:
        await asyncio.wait_for(to_thread.run_sync(state.registry.ping), timeout=3.0)
        checks["postgres"] = "ok"
    except (SluiceError, TimeoutError) as exc:
        checks["postgres"] = f"down: {exc}"
    checks["routing"] = (
        "not loaded" if not state.routing.loaded else ("stale" if state.routing.degraded else "ok")
    )
    checks["events"] = "ok" if state.hub.connected.is_set() else "down"
    if state.draining.is_set():
        return JSONResponse({"status": "draining", "checks": checks}, status_code=503)
    ready = checks["redis"] == "ok" and state.routing.loaded
    status = "ok" if ready and all(v == "ok" for v in checks.values()) else ("degraded" if ready else "unready")
    return JSONResponse({"status": status, "checks": checks, "breakers": state.breakers.states()},
                        status_code=200 if ready else 503)


@router.get("/metrics", include_in_schema=False)
async def metrics() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
