"""Submitting jobs, reading them (poll, long-poll, server-sent events) and cancelling them."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Annotated, Any

from anyio import to_thread
from fastapi import APIRouter, Header, Query
from fastapi.responses import StreamingResponse
from pydantic import AnyHttpUrl, AwareDatetime, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from api.deps import AppState, CurrentKey, StateDep, checked_callback
from api.event_hub import FinalWatch
from api.field_types import FileUri
from api.json_response import JsonResponse
from api.middleware import StrictJsonRoute
from api.response_models import BulkAccepted, ErrorResource, JobResource
from api.standings import standings
from sluice.errors import (
    Conflict,
    InvalidInput,
    JobExpired,
    NotServed,
    PayloadTooLarge,
    ServiceUnavailable,
    TooManyRequests,
)
from sluice.fair_share import DEFAULT_PRIORITY
from sluice.kinds import SCHEMA_KINDS, ModelKind, validate_input
from sluice.logs import current_request_id
from sluice.metrics import CACHE_LOOKUPS, JOBS_FINISHED, JOBS_REJECTED, JOBS_SUBMITTED
from sluice.queue_standing import Standing
from sluice.references import SHA256_PATTERN, InputRef, OutputRef, check_input, check_output, cost_hint
from sluice.registry.catalog import MAX_QUEUE_S
from sluice.registry.tenants import KeyInfo
from sluice.retry import RETRY_ON, RetryOn, RetryPolicy
from sluice.routing import VersionInfo, hash_unit, route, shadow_target
from sluice.vocabulary import Lane
from sluice.wire import keys, response_cache
from sluice.wire.idempotency import IdempotencyClaim
from sluice.wire.jobs import JobRecord, JobStatus, JobView

router = APIRouter(prefix="/v1", tags=["jobs"], route_class=StrictJsonRoute)

# An event stream sends a comment when nothing else went out for this long (proxies drop idle
# connections), and re-reads a queued job's place this often.
KEEP_ALIVE_S = 15.0
POSITION_EVERY_S = 1.0

MetadataValue = str | int | float | bool | None

_SUBMIT_ERRORS: dict[int | str, dict[str, Any]] = {
    403: {"model": ErrorResource, "description": "Not entitled to the version: `forbidden`, or `not_servable` "
                                                 "for a staged or shadow version named by a tenant"},
    404: {"model": ErrorResource, "description": "Unknown model or version; `job_expired` when an "
                                                 "Idempotency-Key replay's jobs have expired"},
    409: {"model": ErrorResource, "description": "Retired version, or Idempotency-Key reused or in flight"},
    413: {"model": ErrorResource, "description": "Too many inputs, or an object at `input_uri` over "
                                                 "SLUICE_MAX_OBJECT_BYTES"},
    422: {"model": ErrorResource, "description": "An input the model kind refuses, or an `input_uri` or "
                                                 "`output_uri` that names no object the key may use (one answer "
                                                 "for missing and forbidden alike)"},
    429: {"model": ErrorResource, "description": "Rate limit, quota, `stored_jobs_limit` (too many stored jobs "
                                                 "answered from the response cache) or load shedding, with "
                                                 "`Retry-After`; load shedding of the online lane says "
                                                 "`retry_with: {lane: bulk}`"},
    503: {"model": ErrorResource, "description": "No servable version, an open circuit breaker, draining, or "
                                                 "`not_served`: the version routed to cannot be served now "
                                                 "(no placement possible, its artifact refused), with why; "
                                                 "or the object store did not answer"},
}

_LANES = ("`online`: load-shed, a 429 (with `retry_with`) when the predicted queue wait exceeds the version's "
          "latency budget. `bulk`: batch scoring, never shed, run when the online lane has nothing ready. "
          "A single job defaults to `online`, a bulk submission to `bulk`.")


def _iso_text(value: object) -> object:
    # One spelling of an instant: a number could be seconds or milliseconds, and naive text any zone.
    if not isinstance(value, str):
        raise ValueError("start_by must be an ISO 8601 instant with its UTC offset, e.g. 2026-12-04T18:30:00Z")
    return value


class Retry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_attempts: int = Field(ge=1, description="Starts in all, the first included; at most the server's "
                                                "`SLUICE_RETRY_MAX_ATTEMPTS` (5 by default)")
    on: list[RetryOn] = Field(min_length=1, max_length=len(RETRY_ON), description=(
        "The failures that put the job back in its queue while attempts are left: `worker_error` (its run "
        "ended without an outcome: a handler fault or a worker that died), `timeout` (its batch ran past the "
        "server's per-batch timeout, `handler_timeout`), `run_timeout` (past the job's own `run_timeout_s`). "
        "An input the model refuses (`inference_error`) is never retried"))


class _JobOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: str | None = Field(default=None, min_length=1, max_length=64)
    routing_key: str | None = Field(default=None, min_length=1, max_length=256)
    callback_url: AnyHttpUrl | None = None
    timeout_s: float | None = Field(default=None, gt=0, le=MAX_QUEUE_S, description=(
        "Seconds from submission by which the job must start, else it is `expired` (code `expired`), "
        "whether or not a worker serves the version. With neither this nor `start_by`, the version's "
        "`max_queue_s` applies, if it has one"))
    start_by: Annotated[AwareDatetime, BeforeValidator(_iso_text)] | None = Field(default=None, description=(
        "The instant by which the job must start, as ISO 8601 with its UTC offset (`2026-12-04T18:30:00Z`); "
        "like `timeout_s` but absolute, and with both the earlier wins. In the future, at most 7 days ahead. "
        "A retried attempt must start by it too"))
    run_timeout_s: float | None = Field(default=None, gt=0, description=(
        "The longest one batch holding this job may run on the model; past it the job fails with code "
        "`run_timeout` (its pass runs on, its result discarded). At most the server's per-batch timeout "
        "(`SLUICE_BATCH_TIMEOUT_S`, 120 s by default). Without it, the version's `run_timeout_s` applies, "
        "if it has one"))
    retry: Retry | None = Field(default=None, description="Re-queue the job after the failures listed, "
                                                          "up to `max_attempts` starts")
    priority: int = Field(default=DEFAULT_PRIORITY, ge=0, le=2, description=(
        "Within the version and lane: 0 runs first, 1 (the default) next, 2 last; fair between tenants "
        "within each. A job that has waited `SLUICE_PRIORITY_AGEING_S` (10 s by default) runs as 0, so the "
        "lowest still progresses. Under load, admission refuses 2 first and 0 last"))
    metadata: dict[str, MetadataValue] | None = Field(default=None, max_length=32)


_INPUT = "The model kind's input, e.g. {\"text\": \"...\"}; give it or `input_uri`"
_INPUT_URI = ("Instead of `input`: an object holding the input (JSON), named by its path relative to the "
              "tenant's folder under SLUICE_BATCH_ROOT or a file:// URI inside it, or by its URL in the tenant's "
              "folder of the object store, `<SLUICE_OBJECT_ROOT>/tenants/<tenant>/` (a relative path names that "
              "folder on a platform without SLUICE_BATCH_ROOT). The API checks that it "
              "exists and is within SLUICE_MAX_OBJECT_BYTES; the worker reads it when the job runs. A reference "
              "the key may not read gets the answer a missing object gets")
_SHA256 = ("With `input_uri`: the object's sha256 (hex); the worker verifies it before running, and a mismatch "
           "fails the job (`input_checksum_mismatch`)")
_OUTPUT_URI = ("Where the worker writes the job's output (JSON) instead of keeping it in the job: a path or "
               "an object in the tenant's folder, as `input_uri`; the job then shows `output_uri`, `output_size` and "
               "`output_sha256` instead of `output`")


class _Payload(BaseModel):
    """One job's input, inline or by reference, and where its output goes."""

    model_config = ConfigDict(extra="forbid")

    input: Any = Field(default=None, description=_INPUT)
    input_uri: FileUri | None = Field(default=None, description=_INPUT_URI)
    sha256: str | None = Field(default=None, pattern=SHA256_PATTERN, description=_SHA256)
    output_uri: FileUri | None = Field(default=None, description=_OUTPUT_URI)

    @model_validator(mode="after")
    def _one_input(self) -> _Payload:
        # `"input": null` counts as given: it is refused as an input, not taken for a missing one.
        if ("input" in self.model_fields_set) == (self.input_uri is not None):
            raise ValueError("give exactly one of 'input' and 'input_uri'")
        if self.sha256 is not None and self.input_uri is None:
            raise ValueError("'sha256' is the checksum of the object at 'input_uri'; give it only with input_uri")
        return self


class SubmitJob(_JobOptions, _Payload):
    lane: Lane = Field(default="online", description=_LANES)

    def payloads(self) -> list[_Payload]:
        return [self]


class BulkJob(_Payload):
    """One job of a bulk submission, when it gives more than its input."""


class SubmitBulk(_JobOptions):
    inputs: list[Any] | None = Field(default=None, min_length=1, description="The jobs' inputs, one job each")
    jobs: list[BulkJob] | None = Field(default=None, min_length=1,
                                       description="Instead of `inputs`: one object per job, each with its "
                                                   "`input` or `input_uri` (and `sha256`), and `output_uri`")
    lane: Lane = Field(default="bulk", description=_LANES)

    @model_validator(mode="after")
    def _one_list(self) -> SubmitBulk:
        if (self.inputs is None) == (self.jobs is None):
            raise ValueError("give exactly one of 'inputs' and 'jobs'")
        return self

    def payloads(self) -> list[_Payload]:
        if self.jobs is not None:
            return list(self.jobs)
        # Not validated again, one model per input: a bulk submission's CPU is the API's hot path.
        return [_Payload.model_construct(input=item) for item in self.inputs or []]


@dataclass(frozen=True, slots=True)
class _Refs:
    input: InputRef | None = None
    output: OutputRef | None = None


# Fields left out of the request's hash while unset, so an Idempotency-Key's hash from before they
# existed still matches the same request.
_REFERENCE_FIELDS = frozenset({"input_uri", "sha256", "output_uri", "jobs"})


def _request_hash(model: str, body: BaseModel) -> str:
    unset = {name for name in _REFERENCE_FIELDS & set(type(body).model_fields) if getattr(body, name) is None}
    canonical = json.dumps([model, body.model_dump(mode="json", exclude=unset)], sort_keys=True,
                           separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


async def _claim_key(state: AppState, key: KeyInfo, model: str, options: SubmitJob | SubmitBulk,
                     idempotency_key: str | None) -> IdempotencyClaim | None:
    if not idempotency_key:
        return None
    if len(idempotency_key) > 255:
        raise InvalidInput("Idempotency-Key must be at most 255 characters")
    return await state.broker.claim_idempotency_key(key.tenant, idempotency_key, _request_hash(model, options))


@dataclass(slots=True)
class _Submitted:
    records: list[JobRecord]
    replayed: bool = False  # made by an earlier identical submission (its Idempotency-Key)
    # Armed before the jobs were written (`watch` of `_admit`): a final state written since wakes it.
    watch: FinalWatch | None = None


async def _admit(
    state: AppState, key: KeyInfo, model: str, options: SubmitJob | SubmitBulk, inputs: list[_Payload],
    idempotency_key: str | None, *, watch: bool = False,
) -> _Submitted:
    """The jobs of this submission, whether they were made by an earlier identical one, and with
    `watch`, a watch on the new jobs armed before they were written.

    A replay is answered before anything else is checked: the request was accepted once, and a
    client retrying it must get that answer from a draining replica or past an open breaker too.
    """
    claim = await _claim_key(state, key, model, options, idempotency_key)
    if claim is not None and claim.replay is not None:
        return _Submitted(await _replayed(state, claim.replay), replayed=True)
    try:
        return await _queue(state, key, model, options, inputs, claim, watch=watch)
    except BaseException:
        if claim is not None:
            await state.broker.release_idempotency_key(claim)
        raise


async def _replayed(state: AppState, job_ids: list[str]) -> list[JobRecord]:
    records = await state.broker.get_many(job_ids)
    found = [record for record in records if record is not None]
    if len(found) < len(records):
        raise JobExpired("the jobs this Idempotency-Key created have expired and their results are gone; "
                         "submit with a new key to run the request again")
    return found


async def _queue(
    state: AppState, key: KeyInfo, model: str, options: SubmitJob | SubmitBulk, inputs: list[_Payload],
    claim: IdempotencyClaim | None, *, watch: bool,
) -> _Submitted:
    submitted_at = time.time()
    deadline, run_timeout_s, retry = _limits(state, options, now=submitted_at)
    snapshot = state.routing.current()
    info = snapshot.model(model)
    kind = ModelKind(info.kind)
    refs = await _references(state, key, model, inputs)
    # A kind that fixes its schema is checked before routing; a declared schema is the routed version's.
    validated = [] if kind in SCHEMA_KINDS else _validated(state, model, kind, options, inputs, refs, schema=None)
    try:
        callback_url = checked_callback(state, options.callback_url)
    except InvalidInput:
        JOBS_REJECTED.labels(model, InvalidInput.code).inc()
        raise
    if state.draining.is_set():
        raise ServiceUnavailable("this API replica is shutting down; retry", headers={"Retry-After": "1"})
    decision = route(snapshot, model=model, tenant=key.tenant, routing_key=options.routing_key,
                     version=options.version, blocked=state.breakers.blocked(model), admin=key.is_admin)
    version = decision.version
    deadline, run_timeout_s = version_defaults(version, deadline=deadline, run_timeout_s=run_timeout_s,
                                               submitted_at=submitted_at,
                                               batch_timeout_s=state.settings.batch_timeout_s)
    unserved = state.placement.not_served(model, version.version)
    if unserved is not None:
        JOBS_REJECTED.labels(model, NotServed.code).inc()
        raise NotServed(f"{model}/{version.version} cannot be served now: {unserved}",
                        headers={"Retry-After": "30"})
    if kind in SCHEMA_KINDS:
        validated = _validated(state, model, kind, options, inputs, refs, schema=version.input_schema)
    # No await since `blocked`: a half-open version this job was routed to still has its slot free.
    probe = state.breakers.take_probe(model, version.version)
    now = time.time()
    request_id = current_request_id()
    armed: FinalWatch | None = None
    records = []
    for (canonical, cost), ref in zip(validated, refs, strict=True):
        job_id = keys.new_job_id(model, version.version)
        # No shadow copy of a job by reference: the copy runs as nobody's, and the object is the tenant's.
        shadow = None if ref.input or ref.output else shadow_target(snapshot, model=model, primary=version,
                                                                      point=hash_unit(model, job_id))
        records.append(JobRecord(
            id=job_id, tenant=key.tenant, model=model, version=version.version,
            lane=options.lane, status=JobStatus.queued, input=canonical, cost=cost, enqueued_at=now,
            callback_url=callback_url,
            deadline=deadline, run_timeout_s=run_timeout_s, retry=retry, priority=options.priority, share=key.share,
            metadata=dict(options.metadata or {}),
            shadow=_served(state, model, shadow), request_id=request_id, input_ref=ref.input, output_ref=ref.output,
        ))
    try:
        if version.cache_ttl_s > 0:
            records = await _answer_cached(state, version, records)
            if probe is not None and all(record.cache_hit for record in records):
                # Answered without the version: these jobs tell its breaker nothing.
                state.breakers.return_probe(probe)
                probe = None
        if watch:
            # Armed before the write, a watch cannot miss the jobs' final states, so the waiter
            # need not read them back first (`_wait_final`).
            pending = [record.id for record in records if not record.cache_hit]
            armed = await state.hub.watch_final(pending) if pending else None
        await state.admission.queue(key, version, records, idempotency=claim)
    except BaseException as exc:
        if armed is not None:
            state.hub.unwatch_final(pending, armed)
        if probe is not None:
            state.breakers.return_probe(probe)
        if isinstance(exc, TooManyRequests):
            JOBS_REJECTED.labels(model, exc.code).inc()
        raise
    JOBS_SUBMITTED.labels(model, version.version, options.lane).inc(len(records))
    return _Submitted(records, watch=armed)


def _limits(state: AppState, options: SubmitJob | SubmitBulk, *, now: float) -> tuple[float | None, float | None,
                                                                                  str | None]:
    """The submission's start deadline (the earlier of `timeout_s` and `start_by`), run limit and
    encoded retry policy, each checked against the server's bounds."""
    deadlines = [now + options.timeout_s] if options.timeout_s else []
    if options.start_by is not None:
        start_by = options.start_by.timestamp()
        if start_by <= now:
            raise InvalidInput(f"start_by {options.start_by.isoformat()} has passed; name an instant ahead")
        if start_by > now + MAX_QUEUE_S:
            raise InvalidInput("start_by is more than 7 days ahead")
        deadlines.append(start_by)
    settings = state.settings
    if options.run_timeout_s is not None and options.run_timeout_s > settings.batch_timeout_s:
        raise InvalidInput(f"run_timeout_s must be at most {settings.batch_timeout_s:g}, this server's "
                           "per-batch timeout")
    retry = None
    if options.retry is not None:
        if options.retry.max_attempts > settings.retry_max_attempts:
            raise InvalidInput(f"retry.max_attempts must be at most {settings.retry_max_attempts} on this server")
        retry = RetryPolicy(max_attempts=options.retry.max_attempts,
                            on=tuple(dict.fromkeys(options.retry.on))).encode()
    return (min(deadlines) if deadlines else None), options.run_timeout_s, retry


def version_defaults(version: VersionInfo, *, deadline: float | None, run_timeout_s: float | None,
                     submitted_at: float, batch_timeout_s: float) -> tuple[float | None, float | None]:
    """A job's start deadline and run limit, the routed version's defaults filling what the request
    left out: a request's own limit always wins, longer or shorter than the default."""
    if deadline is None and version.max_queue_s is not None:
        deadline = submitted_at + version.max_queue_s
    if run_timeout_s is None and version.run_timeout_s is not None:
        # The per-batch timeout may have been lowered since the default was set; it still bounds it.
        run_timeout_s = min(version.run_timeout_s, batch_timeout_s)
    return deadline, run_timeout_s


def _served(state: AppState, model: str, shadow: str | None) -> str | None:
    """No shadow copy for a shadow version no worker can serve: it would never run."""
    return None if shadow is not None and state.placement.not_served(model, shadow) else shadow


async def _references(state: AppState, key: KeyInfo, model: str, inputs: list[_Payload]) -> list[_Refs]:
    """Each job's references, checked (on a thread: the checks touch the file system or the object
    store)."""
    if all(item.input_uri is None and item.output_uri is None for item in inputs):
        return [_Refs()] * len(inputs)
    settings = state.settings

    def check() -> list[_Refs]:
        return [_Refs(
            input=None if item.input_uri is None else check_input(
                item.input_uri, item.sha256, root=settings.batch_root, tenant=key.tenant, admin=key.is_admin,
                max_bytes=settings.max_object_bytes, objects=state.objects),
            output=None if item.output_uri is None else check_output(
                item.output_uri, root=settings.batch_root, tenant=key.tenant, admin=key.is_admin,
                objects=state.objects),
        ) for item in inputs]

    try:
        return await to_thread.run_sync(check)
    except (InvalidInput, PayloadTooLarge, ServiceUnavailable) as exc:
        JOBS_REJECTED.labels(model, exc.code).inc()
        raise


def _validated(state: AppState, model: str, kind: ModelKind, options: SubmitJob | SubmitBulk,
               inputs: list[_Payload], refs: list[_Refs], *, schema: str | None) -> list[tuple[dict[str, Any], int]]:
    """Each job's canonical input and cost hint; a job by reference has none until its worker reads it."""
    validated: list[tuple[dict[str, Any], int]] = []
    for index, (payload, ref) in enumerate(zip(inputs, refs, strict=True)):
        if ref.input is not None:
            validated.append(({}, cost_hint(ref.input)))
            continue
        try:
            validated.append(validate_input(kind, payload.input, max_text_chars=state.settings.max_text_chars,
                                            schema=schema))
        except InvalidInput as exc:
            JOBS_REJECTED.labels(model, exc.code).inc()
            where = "input"
            if isinstance(options, SubmitBulk):
                where = f"jobs[{index}].input" if options.jobs is not None else f"inputs[{index}]"
            raise InvalidInput(exc.message.replace("input", where, 1)) from None
    return validated


async def _answer_cached(state: AppState, version: VersionInfo, records: list[JobRecord]) -> list[JobRecord]:
    """The jobs with those the version's response cache answers made final (`cache_hit`); the
    others carry their cache key, for the worker to store their output under. A job by reference
    bypasses the cache: its input is not known here, and its output goes to its own object."""
    cacheable = [record for record in records if record.input_ref is None and record.output_ref is None]
    if not cacheable:
        return records
    names = response_cache.cache_keys(version.model, version.version, records[0].tenant,
                                      [record.input for record in cacheable])
    found = await response_cache.lookup(state.broker.redis, names)
    hits = sum(1 for output in found if output is not None)
    CACHE_LOOKUPS.labels(version.model, version.version, "hit").inc(hits)
    CACHE_LOOKUPS.labels(version.model, version.version, "miss").inc(len(found) - hits)
    at = time.time()
    answered = {
        record.id: response_cache.answered(record, output, at=at) if output is not None
        else replace(record, cache_key=name, cache_ttl_s=version.cache_ttl_s)
        for record, name, output in zip(cacheable, names, found, strict=True)
    }
    return [answered.get(record.id, record) for record in records]


_SUBMIT_WAIT = (
    "Submit and wait: hold the answer up to this many seconds (capped by the server) for the job "
    "to be final; 200 with the final job if it is, else 202 with the job as it is then"
)


@router.post("/models/{model}/jobs", status_code=202, response_model=JobResource,
             responses={200: {"description": "With `wait`: the job, final within the wait"},
                        202: {"description": "The queued job"}, **_SUBMIT_ERRORS})
async def submit_job(
    model: str, body: SubmitJob, key: CurrentKey, state: StateDep,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
    wait: Annotated[float, Query(ge=0, description=_SUBMIT_WAIT)] = 0,
) -> JsonResponse:
    wait_s = min(wait, state.settings.max_wait_s)
    waits = wait_s > 0 and not state.draining.is_set()
    submitted = await _admit(state, key, model, body, body.payloads(), idempotency_key, watch=waits)
    record = submitted.records[0]
    headers = {"Location": f"/v1/jobs/{record.id}"}
    if submitted.replayed:
        headers["Idempotent-Replayed"] = "true"
    if not waits or record.cache_hit:
        return JsonResponse(record.resource(), status_code=200 if record.is_final and waits else 202,
                            headers=headers)
    # One request per job for a client that wants its result: the accept is already durable, so
    # a client that gives up on this answer polls the Location like any other.
    job = await _wait_final(state, record.id, key.tenant, wait_s, armed=submitted.watch)
    return JsonResponse(await _body(state, job), status_code=200 if job.is_final else 202, headers=headers)


@router.post("/models/{model}/jobs:bulk", status_code=202, response_model=BulkAccepted, responses=_SUBMIT_ERRORS)
async def submit_bulk(
    model: str, body: SubmitBulk, key: CurrentKey, state: StateDep,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
) -> JsonResponse:
    payloads = body.payloads()
    if len(payloads) > state.settings.max_bulk_items:
        raise PayloadTooLarge(f"{len(payloads)} inputs; at most {state.settings.max_bulk_items} per request")
    submitted = await _admit(state, key, model, body, payloads, idempotency_key)
    records = submitted.records
    accepted = {"ids": [r.id for r in records], "model": model, "version": records[0].version if records else "",
                "count": len(records)}
    return JsonResponse(accepted, status_code=202,
                        headers={"Idempotent-Replayed": "true"} if submitted.replayed else None)


@router.get("/jobs/{job_id}", response_model=JobResource, response_model_exclude_unset=True)
async def get_job(
    job_id: str, key: CurrentKey, state: StateDep,
    wait: Annotated[float, Query(ge=0, description="Long-poll up to this many seconds for a final state")] = 0,
) -> JsonResponse:
    wait_s = min(wait, state.settings.max_wait_s)
    if wait_s <= 0 or state.draining.is_set():
        return JsonResponse(await _body(state, await state.broker.view_for_tenant(job_id, key.tenant)))
    return JsonResponse(await _body(state, await _wait_final(state, job_id, key.tenant, wait_s)))


async def _body(state: AppState, job: JobView) -> bytes:
    """The job resource, with `queue_position` and `estimated_start_s` while it is queued."""
    if job.status is not JobStatus.queued:
        return job.body()
    return job.body((await standings(state, [job])).get(job.id))


async def _wait_final(state: AppState, job_id: str, tenant: str, wait_s: float, *,
                      armed: FinalWatch | None = None) -> JobView:
    """The job once it is final, or as it is after ``wait_s`` or when the replica starts draining.
    `armed`: a watch on the job set before it was written, so there is no state to read first."""
    deadline = time.monotonic() + wait_s
    # Watched before the read, so a final state written after it still wakes the wait; `running`
    # does not: each wake-up costs a read, and only a final state ends the long-poll.
    watch = armed if armed is not None else await state.hub.watch_final((job_id,))
    try:
        job = None if armed is not None else await state.broker.view_for_tenant(job_id, tenant)
        while (job is None or not job.is_final) and not state.draining.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await watch.event.wait()
            watch.take()
            job = await state.broker.view_for_tenant(job_id, tenant)
    finally:
        state.hub.unwatch_final((job_id,), watch)
    return job if job is not None else await state.broker.view_for_tenant(job_id, tenant)


@router.get("/jobs/{job_id}/events", response_class=StreamingResponse,
            responses={200: {"content": {"text/event-stream": {}}}})
async def job_events(job_id: str, key: CurrentKey, state: StateDep) -> StreamingResponse:
    first = await state.broker.get_for_tenant(job_id, key.tenant)

    async def stream() -> AsyncIterator[bytes]:
        record: JobRecord | None = first
        last_status: str | None = None
        last_standing: Standing | None = None
        sequence = 0
        event: asyncio.Event | None = None
        quiet_s = 0.0
        try:
            while record is not None:
                standing = (await standings(state, [record])).get(record.id)
                if record.status != last_status:
                    sequence += 1
                    last_status, last_standing = record.status, standing
                    data = json.dumps(record.resource(standing), separators=(",", ":"))
                    yield f"id: {sequence}\nevent: {record.status}\ndata: {data}\n\n".encode()
                elif standing is not None and standing != last_standing:
                    # While queued the job's place is re-read each second: the client sees it fall.
                    sequence += 1
                    last_standing, quiet_s = standing, 0.0
                    data = json.dumps(dataclasses.asdict(standing), separators=(",", ":"))
                    yield f"id: {sequence}\nevent: position\ndata: {data}\n\n".encode()
                if record.is_final or state.draining.is_set():
                    return
                # One watch for the whole stream (each costs the job's channel a subscribe), armed
                # before each read so that a change after the read still wakes the wait.
                if event is None:
                    event = await state.hub.watch(job_id)
                event.clear()
                record = await state.broker.get(job_id)
                if record is not None and record.status == last_status:
                    timeout = POSITION_EVERY_S if record.status is JobStatus.queued else KEEP_ALIVE_S
                    try:
                        await asyncio.wait_for(event.wait(), timeout=timeout)
                    except TimeoutError:
                        quiet_s += timeout
                        if quiet_s >= KEEP_ALIVE_S:
                            quiet_s = 0.0
                            yield b": keep-alive\n\n"
                    record = await state.broker.get(job_id)
        finally:
            if event is not None:
                state.hub.unwatch(job_id, event)

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@router.delete("/jobs/{job_id}", response_model=JobResource, response_model_exclude_unset=True)
async def cancel_job(job_id: str, key: CurrentKey, state: StateDep) -> dict[str, Any]:
    record = await state.broker.get_for_tenant(job_id, key.tenant)
    blocking = await state.broker.cancel(record)
    if blocking is not None:
        raise Conflict(f"job '{job_id}' is {blocking}; only a queued job can be cancelled")
    JOBS_FINISHED.labels(record.model, record.version, JobStatus.cancelled.value).inc()
    record = await state.broker.get_for_tenant(job_id, key.tenant)
    return record.resource()
