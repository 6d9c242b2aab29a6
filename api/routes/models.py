"""The model registry over REST: models, versions, routing weights, rollback."""

from __future__ import annotations

import statistics
import time
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

from anyio import to_thread
from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict, Field

from api.deps import AdminKey, AppState, CurrentKey, OperatorKey, StateDep, announce_routing
from api.field_types import Kind, Name, ServingState, State
from api.queue_gauges import read_queues, serving_versions
from api.response_models import (
    AuditLog,
    MixResource,
    ModelList,
    ModelResource,
    QualityResource,
    QueueResource,
    RoutingChange,
    StatsResource,
    StatsSeriesResource,
    VersionChange,
    VersionResource,
)
from sluice.errors import BadRequest, InvalidInput, NotFound
from sluice.mix import BUCKET_LABELS, Mix
from sluice.registry import audit, catalog, quality, routing_table, tuning
from sluice.registry import mix as mix_rows
from sluice.registry.catalog import MAX_QUEUE_S
from sluice.stats import MAX_SERIES_BUCKETS, check_series_window, series, summarise
from sluice.versions import Tier, VersionState
from sluice.wire import heartbeats, mix
from sluice.wire.response_cache import MAX_TTL_S

router = APIRouter(prefix="/v1/models", tags=["models"])

_CACHE_TTL = ("Seconds the version's response cache keeps an output: a later submission by the same tenant "
              "of the same input is answered at once, `succeeded` with `cache_hit: true`, without a worker. "
              "0 (the default) caches nothing")

_MAX_QUEUE = ("Seconds from submission within which a job of this version must start when it names neither "
              "`start_by` nor `timeout_s`, else it is `expired`; more than 0, at most 7 days. A job's own "
              "limit always wins. Null (the default): no default, such a job waits as long as it must")
_RUN_TIMEOUT = ("The run limit (`run_timeout_s`) of a job of this version that names none: the longest one batch "
                "holding it may run, else it fails `run_timeout`. More than 0, at most the server's per-batch "
                "timeout (`SLUICE_BATCH_TIMEOUT_S`). A job's own limit always wins. Null (the default): none")
_LIMIT_CHANGE = " On update, null clears it and leaving it out keeps it"

_TIER = ("The model's availability tier: the scheduler meets every `latency` model's need for workers "
         "before a `batch` model gets more than nothing")


_HANDLER = ("Kind `handler` only, and required there: the class serving the version, `package.module:Class`, "
            "a subclass of `sluice.handler.Handler` importable in the workers' environment")

_SCHEMA = ("Kinds `handler` and `torch-export`: the JSON Schema (2020-12) of {what}, a JSON object. The API "
           "checks every input against the input schema before queueing it. Required for `torch-export` "
           "(one property per tensor of the program, in order); for `handler`, `sluice models register` "
           "records the class's own schemas")


_ALLOW_PICKLE = ("Kind `torch-export` only; an admin key's choice, written to the audit log. True loads the "
                 "version's `program.pt2` even when a pickle in it could run code in the worker (torch "
                 "unpickles parts of the archive with `weights_only=False`); false (the default) refuses "
                 "such an archive and records why in `last_error`. Set it only for an archive you trust whole")


class CreateModel(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Name
    kind: Kind
    tier: Tier = Field(default=Tier.latency, description=_TIER)


class Batching(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_batch_size: int = Field(default=32, ge=1, le=1024)
    max_wait_ms: float = Field(default=10.0, ge=0, le=60_000)
    isolate_tenants: bool = True


class Tuning(BaseModel):
    """What the nightly re-tune works to (scheduler/retune.py)."""

    model_config = ConfigDict(extra="forbid")
    p99_budget_ms: float | None = Field(default=None, gt=0, le=600_000, description=(
        "The p99 latency the batching is tuned to: the nightly job proposes the setting with the highest "
        "sustained throughput whose simulated p99 meets it. Null: the version is not re-tuned"))
    auto_tune: bool | None = Field(default=None, description=(
        "True: the nightly job applies its proposal itself (audited, as this PATCH) when the predicted gain is "
        "over the platform's threshold; false: a person applies it (`apply_proposal`)"))


class RegisterVersion(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: Name
    artifact: str = Field(min_length=1, max_length=1024)
    sha256: str = Field(pattern=r"^[0-9a-fA-F]{64}$")
    state: ServingState = VersionState.staged
    batching: Batching = Field(default_factory=Batching)
    min_replicas: int = Field(default=1, ge=0, le=64)
    max_replicas: int = Field(default=4, ge=1, le=256)
    cache_ttl_s: int = Field(default=0, ge=0, le=MAX_TTL_S, description=_CACHE_TTL)
    max_queue_s: float | None = Field(default=None, gt=0, le=MAX_QUEUE_S, description=_MAX_QUEUE)
    run_timeout_s: float | None = Field(default=None, gt=0, description=_RUN_TIMEOUT)
    handler: str | None = Field(default=None, max_length=200, description=_HANDLER)
    input_schema: dict[str, Any] | None = Field(default=None, description=_SCHEMA.format(what="one input"))
    output_schema: dict[str, Any] | None = Field(default=None, description=_SCHEMA.format(what="one output"))
    allow_pickle: bool = Field(default=False, description=_ALLOW_PICKLE)


class UpdateVersion(BaseModel):
    model_config = ConfigDict(extra="forbid")
    state: State | None = None
    batching: Batching | None = None
    min_replicas: int | None = Field(default=None, ge=0, le=64)
    max_replicas: int | None = Field(default=None, ge=1, le=256)
    cache_ttl_s: int | None = Field(default=None, ge=0, le=MAX_TTL_S, description=_CACHE_TTL)
    max_queue_s: float | None = Field(default=None, gt=0, le=MAX_QUEUE_S, description=_MAX_QUEUE + _LIMIT_CHANGE)
    run_timeout_s: float | None = Field(default=None, gt=0, description=_RUN_TIMEOUT + _LIMIT_CHANGE)
    tier: Tier | None = Field(default=None, description=_TIER + " (set for the whole model)")
    allow_pickle: bool | None = Field(default=None, description=_ALLOW_PICKLE)
    tuning: Tuning | None = Field(default=None, description="The p99 budget and auto_tune; a field left out "
                                  "is kept, a budget given as null is cleared")
    apply_proposal: bool = Field(default=False, description=(
        "Set the batching to the nightly job's proposal (`batching.proposal`) and date it (`batching.tuned_at`, "
        "`tuned_on`); 409 where there is none. Not with `batching`"))
    reason: str | None = Field(default=None, max_length=500)


class Rollback(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: str | None = Field(default=None, max_length=500)


class SetRouting(BaseModel):
    model_config = ConfigDict(extra="forbid")
    weights: dict[str, Annotated[float, Field(ge=0, le=1e6)]] = Field(min_length=1, max_length=64)
    reason: str | None = Field(default=None, max_length=500)


@router.get("", response_model=ModelList)
async def list_models(_: CurrentKey, state: StateDep) -> dict[str, Any]:
    def read() -> list[dict[str, Any]]:
        with state.registry.session() as session:
            return catalog.list_models(session)

    return {"models": await _with_replicas(state, await to_thread.run_sync(read))}


async def _with_replicas(state: AppState, resources: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The model resources with the scheduler's last decision for each version, read in one round trip."""
    keys = [(resource["name"], version["version"]) for resource in resources for version in resource["versions"]]
    decisions = await state.broker.scaling_decisions(keys)
    for resource in resources:
        for version in resource["versions"]:
            version["replicas"] = decisions.get((resource["name"], version["version"]))
    return resources


@router.post("", status_code=201, response_model=ModelResource)
async def create_model(body: CreateModel, key: AdminKey, state: StateDep) -> dict[str, Any]:
    def write() -> dict[str, Any]:
        with state.registry.session() as session:
            catalog.create_model(session, name=body.name, kind=body.kind, tier=body.tier,
                                 actor=f"key:{key.key_id}")
        with state.registry.session() as session:
            return catalog.model_resource(session, body.name)

    resource = await to_thread.run_sync(write)
    await announce_routing(state, body.name)
    return resource


@router.get("/{model}", response_model=ModelResource)
async def get_model(model: str, _: CurrentKey, state: StateDep) -> dict[str, Any]:
    def read() -> dict[str, Any]:
        with state.registry.session() as session:
            return catalog.model_resource(session, model)

    [resource] = await _with_replicas(state, [await to_thread.run_sync(read)])
    return resource


@router.post("/{model}/versions", status_code=201, response_model=VersionResource)
async def register_version(model: str, body: RegisterVersion, key: AdminKey, state: StateDep) -> dict[str, Any]:
    def write() -> dict[str, Any]:
        with state.registry.session() as session:
            row = catalog.register_version(
                session, model=model, version=body.version, artifact=body.artifact, sha256=body.sha256,
                actor=f"key:{key.key_id}", state=body.state, max_batch_size=body.batching.max_batch_size,
                max_wait_ms=body.batching.max_wait_ms, isolate_tenants=body.batching.isolate_tenants,
                min_replicas=body.min_replicas, max_replicas=body.max_replicas, cache_ttl_s=body.cache_ttl_s,
                max_queue_s=body.max_queue_s, run_timeout_s=body.run_timeout_s,
                batch_timeout_s=state.settings.batch_timeout_s, handler=body.handler, input_schema=body.input_schema,
                output_schema=body.output_schema, allow_pickle=body.allow_pickle,
            )
            return catalog.version_resource(row)

    resource = await to_thread.run_sync(write)
    await announce_routing(state, model)
    return resource


@router.put("/{model}/routing", response_model=RoutingChange)
async def set_routing(model: str, body: SetRouting, key: AdminKey, state: StateDep) -> dict[str, Any]:
    def write() -> dict[str, Any]:
        with state.registry.session() as session:
            entry = routing_table.set_routing(session, model=model, weights=body.weights,
                                        actor=f"key:{key.key_id}", reason=body.reason)
            return {"routing": catalog.routing_weights(session, model), "audit": audit.audit_resource(entry)}

    result = await to_thread.run_sync(write)
    await announce_routing(state, model)
    return result


@router.get("/{model}/versions/{version}", response_model=VersionResource)
async def get_version(model: str, version: str, _: CurrentKey, state: StateDep) -> dict[str, Any]:
    def read() -> dict[str, Any]:
        with state.registry.session() as session:
            return catalog.version_resource(catalog.get_version(session, model, version))

    resource = await to_thread.run_sync(read)
    now = time.time()
    beats = await heartbeats.live_heartbeats(state.broker.redis, model, version, now=now)
    resource["running_precision"] = running_precision(beats)
    tuned_on = resource["batching"]["tuned_on"]
    if tuned_on:
        hours = await mix.read_hours(state.broker.redis, model, version)
        resource["batching"]["drift"] = mix.lane_drift(hours, Mix.from_mapping(tuned_on["mix"]),
                                                       now_hour=mix.hour_of(now))
    return resource


def running_precision(beats: list[heartbeats.Heartbeat]) -> list[dict[str, Any]]:
    """The live workers grouped by the precision they run, with the median of their measured speed-ups."""
    by_precision: dict[str, list[float | None]] = {}
    for beat in beats:
        if beat.precision:
            by_precision.setdefault(beat.precision, []).append(beat.precision_speedup)
    running = []
    for precision, speedups in sorted(by_precision.items()):
        measured = [s for s in speedups if s is not None]
        running.append({"precision": precision, "workers": len(speedups),
                        "speedup": round(statistics.median(measured), 3) if measured else None})
    return running


@router.patch("/{model}/versions/{version}", response_model=VersionChange)
async def update_version(model: str, version: str, body: UpdateVersion, key: AdminKey,
                         state: StateDep) -> dict[str, Any]:
    batching = body.batching
    # Given as null, a default is cleared; left out, it is kept.
    job_limits: dict[str, float | None] = {
        name: getattr(body, name) for name in ("max_queue_s", "run_timeout_s") if name in body.model_fields_set}

    tuning_change: dict[str, Any] = (
        {name: getattr(body.tuning, name) for name in body.tuning.model_fields_set
         if not (name == "auto_tune" and body.tuning.auto_tune is None)} if body.tuning else {})
    if body.apply_proposal and batching is not None:
        raise BadRequest("apply_proposal sets the batching: not with `batching`")

    changes: dict[str, Any] = {
        "state": body.state, "min_replicas": body.min_replicas, "max_replicas": body.max_replicas,
        "cache_ttl_s": body.cache_ttl_s, "allow_pickle": body.allow_pickle, "job_limits": job_limits,
        "tuning": tuning_change}

    def write() -> dict[str, Any]:
        with state.registry.session() as session:
            if body.apply_proposal:
                row, entry = tuning.apply_proposal(
                    session, model=model, version=version, actor=f"key:{key.key_id}", reason=body.reason,
                    now=datetime.now(UTC), batch_timeout_s=state.settings.batch_timeout_s, changes=changes)
            else:
                row, entry = catalog.update_version(
                    session, model=model, version=version, actor=f"key:{key.key_id}", reason=body.reason,
                    max_batch_size=batching.max_batch_size if batching else None,
                    max_wait_ms=batching.max_wait_ms if batching else None,
                    isolate_tenants=batching.isolate_tenants if batching else None,
                    batch_timeout_s=state.settings.batch_timeout_s, **changes)
            if body.tier is not None:
                catalog.set_tier(session, model=model, tier=body.tier, actor=f"key:{key.key_id}", reason=body.reason)
            return {**catalog.version_resource(row), "audit": audit.audit_resource(entry)}

    result = await to_thread.run_sync(write)
    await announce_routing(state, model)
    return result


@router.post("/{model}/rollback", response_model=RoutingChange)
async def rollback(model: str, key: AdminKey, state: StateDep, body: Rollback | None = None) -> dict[str, Any]:
    def write() -> dict[str, Any]:
        with state.registry.session() as session:
            entry = routing_table.rollback(session, model=model, actor=f"key:{key.key_id}",
                                     reason=body.reason if body else None)
            return {"routing": catalog.routing_weights(session, model), "audit": audit.audit_resource(entry)}

    result = await to_thread.run_sync(write)
    await announce_routing(state, model)
    return result


@router.get("/{model}/versions/{version}/stats", response_model=StatsResource, response_model_exclude_unset=True)
async def version_stats(
    model: str, version: str, _: OperatorKey, state: StateDep,
    window_s: Annotated[float, Query(gt=0, le=86_400)] = 300.0,
) -> dict[str, Any]:
    """Exact percentiles over the finished jobs of one version in the window (never blended). Admin
    only: the figures count every tenant's jobs."""
    if version not in state.routing.current().model(model).versions:
        raise NotFound(f"model '{model}' has no version '{version}'")
    samples = await state.broker.samples(model, version, window_s=window_s)
    beats = await heartbeats.live_heartbeats(state.broker.redis, model, version, now=time.time())
    return {"model": model, "version": version, **summarise(samples, window_s=window_s, prices=state.settings.prices),
            "resident_bytes": max((beat.resident_bytes for beat in beats), default=None)}


@router.get("/{model}/versions/{version}/stats/series", response_model=StatsSeriesResource)
async def version_stats_series(
    model: str, version: str, _: OperatorKey, state: StateDep,
    window_s: Annotated[float, Query(ge=1, le=86_400)] = 300.0,
    step_s: Annotated[float, Query(ge=1, le=3_600, description="The bucket width; the window holds at most "
                                                               f"{MAX_SERIES_BUCKETS} of them")] = 5.0,
) -> dict[str, Any]:
    """The version's finished jobs over time: exact percentiles, rate and errors per bucket (never
    blended). Admin only, like `/stats`."""
    if version not in state.routing.current().model(model).versions:
        raise NotFound(f"model '{model}' has no version '{version}'")
    now = time.time()
    try:
        check_series_window(window_s=window_s, step_s=step_s)
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None
    samples = await state.broker.samples(model, version, window_s=window_s + step_s)
    return {"model": model, "version": version, **series(samples, now=now, window_s=window_s, step_s=step_s)}


@router.get("/{model}/queue", response_model=QueueResource)
async def model_queue(model: str, _: AdminKey, state: StateDep) -> dict[str, Any]:
    """Each serving version's lanes now (lag, pending, oldest entry) and its live workers: what
    `/metrics` shows, for one model, as JSON."""
    now = time.time()
    queues = await read_queues(state.broker.redis, serving_versions(state.routing.current(), model), now=now)
    return {"model": model, "at": now, "versions": [
        {"version": version, "live_workers": queue.live_workers,
         "lanes": {lane: {"lag": lane_queue.lag, "pending": lane_queue.pending,
                          "oldest_age_s": round(lane_queue.oldest_age_s, 3)}
                   for lane, lane_queue in queue.lanes.items()}}
        for (_, version), queue in queues.items()]}


@router.get("/{model}/audit", response_model=AuditLog)
async def audit_log(
    model: str, _: AdminKey, state: StateDep,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    before: Annotated[int | None, Query(ge=1, le=2**63 - 1, description="Entries older than this id")] = None,
) -> dict[str, Any]:
    """Who changed the model's versions, weights, pins and tier, when and why: newest first."""
    def read() -> list[dict[str, Any]]:
        with state.registry.session() as session:
            return [audit.audit_resource(e) for e in audit.audit_entries(session, model, limit=limit,
                                                                              before_id=before)]

    return {"entries": await to_thread.run_sync(read)}


@router.get("/{model}/versions/{version}/mix", response_model=MixResource)
async def version_mix(
    model: str, version: str, _: OperatorKey, state: StateDep,
    days: Annotated[int, Query(ge=1, le=366, description="How many UTC days back, today included")] = 7,
) -> dict[str, Any]:
    """The version's served mix per UTC day and lane, oldest first: inputs counted per cost bucket
    (tokens for text kinds). Admin only, as `/quality`: the days count every tenant's inputs."""
    def read() -> list[dict[str, Any]]:
        since = datetime.now(UTC).date() - timedelta(days=days - 1)
        with state.registry.session() as session:
            catalog.get_version(session, model, version)
            rows = mix_rows.days(session, model=model, version=version, since=since)
        return [{"day": day.isoformat(), "lane": lane, "total": counted.total, "counts": counted.to_mapping()}
                for day, lane, counted in rows]

    return {"model": model, "version": version, "buckets": list(BUCKET_LABELS), "days": await to_thread.run_sync(read)}


@router.get("/{model}/versions/{version}/quality", response_model=QualityResource)
async def version_quality(
    model: str, version: str, _: OperatorKey, state: StateDep,
    hours: Annotated[float, Query(gt=0, le=24 * 90, description="How far back")] = 24.0,
) -> dict[str, Any]:
    """The version's quality aggregates per closed window, oldest first. Admin only: the windows
    count every tenant's jobs, and a classifier's label mix with them."""
    def read() -> list[dict[str, Any]]:
        with state.registry.session() as session:
            catalog.get_version(session, model, version)
            return quality.windows(session, model=model, version=version, since=time.time() - hours * 3600)

    return {"model": model, "version": version, "windows": await to_thread.run_sync(read)}
