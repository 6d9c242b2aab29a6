"""Waiting on many jobs with one request: `GET /v1/jobs?ids=…&wait=N`.

A client with many jobs in flight holds one long-poll instead of one per job: the request answers
as soon as any listed job is final, with those jobs, and the client asks again for the rest. One
`FinalWatch` is registered under every listed id, so a wait costs no task per job, a job going
to `running` wakes nothing, and a wake reads only the jobs the events named.

An id that names no job of the caller (unknown, expired, another tenant's) is answered in
`not_found`, like a final job at once: one expired job must not fail the wait on the others,
and waiting on it could never end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse

from api.deps import AppState, CurrentKey, StateDep
from api.event_hub import FinalWatch
from api.response_models import ErrorResource, JobSet
from api.standings import standings
from sluice.errors import InvalidInput
from sluice.wire.jobs import MAX_WAIT_IDS, JobRecord

router = APIRouter(prefix="/v1", tags=["jobs"])

# Longer strings cannot be job ids (`new_job_id`); they are not worth a Redis read.
_MAX_ID_CHARS = 64

_IDS = (
    f"Job ids, comma-separated in one parameter (`ids=job_a,job_b`), at most {MAX_WAIT_IDS}; "
    "an id listed twice is answered once"
)
_WAIT = (
    "Long-poll up to this many seconds (capped by the server) until any listed job is final or "
    "not found; with none final by then, the answer lists them all as pending"
)


def _listed(ids: str) -> list[str]:
    listed = [job_id for job_id in (part.strip() for part in ids.split(",")) if job_id]
    if not listed:
        raise InvalidInput("ids must name at least one job")
    if len(listed) > MAX_WAIT_IDS:
        raise InvalidInput(f"ids names {len(listed)} jobs; at most {MAX_WAIT_IDS} per request")
    return list(dict.fromkeys(listed))


@router.get(
    "/jobs",
    response_model=JobSet,
    responses={
        200: {"description": "The listed jobs, sorted into final, pending and not found"},
        422: {"model": ErrorResource, "description": f"No ids, or more than {MAX_WAIT_IDS}"},
    },
)
async def wait_jobs(
    key: CurrentKey,
    state: StateDep,
    ids: Annotated[str, Query(description=_IDS)],
    wait: Annotated[float, Query(ge=0, description=_WAIT)] = 0,
) -> JSONResponse:
    """The caller's listed jobs; with `wait`, answers as soon as any of them is final. A draining
    replica answers at once with their current state."""
    listed = _listed(ids)
    readable = [job_id for job_id in listed if job_id.startswith("job_") and len(job_id) <= _MAX_ID_CHARS]
    final: dict[str, JobRecord] = {}
    pending: dict[str, JobRecord] = {}
    missing = set(listed).difference(readable)
    limit = min(wait, state.settings.max_wait_s)
    watch = await state.hub.watch_final(readable) if limit > 0 and readable else None
    try:
        await _settle(state, key.tenant, readable, watch, time.monotonic() + limit, final, missing, pending)
    finally:
        if watch is not None:
            state.hub.unwatch_final(readable, watch)
    body: dict[str, Any] = {
        "jobs": [final[job_id].resource() for job_id in listed if job_id in final],
        "pending": [job_id for job_id in listed if job_id not in final and job_id not in missing],
        "not_found": [job_id for job_id in listed if job_id in missing],
    }
    waiting = await standings(state, [pending[job_id] for job_id in listed
                                      if job_id in pending and job_id not in final])
    if waiting:
        body["queued"] = [{"id": job_id, **dataclasses.asdict(waiting[job_id])} for job_id in listed
                          if job_id in waiting]
    return JSONResponse(body)


async def _settle(
    state: AppState,
    tenant: str,
    readable: list[str],
    watch: FinalWatch | None,
    deadline: float,
    final: dict[str, JobRecord],
    missing: set[str],
    pending: dict[str, JobRecord],
) -> None:
    """Read the jobs until one is final or missing, the deadline passes or the replica drains."""
    to_read = readable
    while True:
        records = await state.broker.get_many(to_read) if to_read else []
        for job_id, record in zip(to_read, records, strict=True):
            if record is None or record.tenant != tenant:
                missing.add(job_id)
            elif record.is_final:
                final[job_id] = record
            else:
                pending[job_id] = record
        if final or missing or watch is None or state.draining.is_set():
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        try:
            await asyncio.wait_for(watch.event.wait(), timeout=remaining)
        except TimeoutError:
            return
        # Empty after a wake_all (a drain, or a subscription gap that may have lost events).
        to_read = sorted(watch.take()) or readable
