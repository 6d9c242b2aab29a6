"""Models and their versions: registering (with the checks a kind and its schemas need), reading
and updating them, and the resources the REST API answers for them."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from sluice.errors import BadRequest, Conflict, InvalidInput, ModelError, NotFound
from sluice.handler import check_spec
from sluice.kinds import SCHEMA_KINDS, ModelKind, check_declared_schema
from sluice.registry import audit
from sluice.registry.tables import (
    AuditEntry,
    Model,
    ModelVersion,
    Pin,
    RoutingWeight,
)
from sluice.versions import Tier, VersionState
from sluice.wire.response_cache import MAX_TTL_S

# The furthest ahead a job's start deadline may be (api/routes/jobs.py), and so a version's default.
MAX_QUEUE_S = 7 * 24 * 3600


def create_model(session: Session, *, name: str, kind: str, actor: str, tier: str = Tier.latency) -> Model:
    if session.get(Model, name) is not None:
        raise Conflict(f"model '{name}' already exists")
    if tier not in tuple(Tier):
        raise BadRequest(f"tier must be one of {', '.join(Tier)}")
    model = Model(name=name, kind=kind, tier=tier)
    session.add(model)
    session.flush()
    audit.record(session, actor=actor, action="model.create", model=name, before=None,
           after={"kind": kind, "tier": tier}, reason=None)
    return model


def set_tier(session: Session, *, model: str, tier: str, actor: str, reason: str | None) -> AuditEntry | None:
    """Move a model to another availability tier; None when it is in that tier already."""
    row = session.get(Model, model)
    if row is None:
        raise NotFound(f"model '{model}' does not exist")
    if tier not in tuple(Tier):
        raise BadRequest(f"tier must be one of {', '.join(Tier)}")
    if row.tier == tier:
        return None
    before = row.tier
    row.tier = tier
    session.flush()
    return audit.record(session, actor=actor, action="model.tier", model=model, before={"tier": before},
                  after={"tier": tier}, reason=reason)


def register_version(
    session: Session,
    *,
    model: str,
    version: str,
    artifact: str,
    sha256: str,
    actor: str,
    state: str = VersionState.staged,
    max_batch_size: int = 32,
    max_wait_ms: float = 10.0,
    isolate_tenants: bool = True,
    min_replicas: int = 1,
    max_replicas: int = 4,
    cache_ttl_s: int = 0,
    max_queue_s: float | None = None,
    run_timeout_s: float | None = None,
    batch_timeout_s: float | None = None,
    handler: str | None = None,
    input_schema: dict[str, Any] | None = None,
    output_schema: dict[str, Any] | None = None,
    allow_pickle: bool = False,
) -> ModelVersion:
    model_row = session.get(Model, model)
    if model_row is None:
        raise NotFound(f"model '{model}' does not exist")
    _check_serving(ModelKind(model_row.kind), handler=handler, input_schema=input_schema, output_schema=output_schema)
    _check_allow_pickle(ModelKind(model_row.kind), allow_pickle)
    if session.get(ModelVersion, (model, version)) is not None:
        raise Conflict(f"model '{model}' already has a version '{version}'")
    if state not in tuple(VersionState):
        raise BadRequest(f"state must be one of {', '.join(VersionState)}")
    if max_replicas < min_replicas:
        raise BadRequest("max_replicas must be >= min_replicas")
    _check_cache_ttl(cache_ttl_s)
    _check_job_limits(max_queue_s=max_queue_s, run_timeout_s=run_timeout_s, batch_timeout_s=batch_timeout_s)
    row = ModelVersion(
        model=model, version=version, artifact=artifact, sha256=sha256.lower(), state=state,
        max_batch_size=max_batch_size, max_wait_ms=max_wait_ms, isolate_tenants=isolate_tenants,
        min_replicas=min_replicas, max_replicas=max_replicas, cache_ttl_s=cache_ttl_s,
        max_queue_s=max_queue_s, run_timeout_s=run_timeout_s,
        handler=handler, input_schema=input_schema, output_schema=output_schema, allow_pickle=allow_pickle,
    )
    session.add(row)
    session.flush()
    after: dict[str, Any] = {"version": version, "artifact": artifact, "sha256": sha256, "state": state}
    if handler is not None:
        after["handler"] = handler
    if allow_pickle:
        after["allow_pickle"] = True
    audit.record(session, actor=actor, action="version.register", model=model, before=None, after=after, reason=None)
    return row


def _check_serving(kind: ModelKind, *, handler: str | None, input_schema: dict[str, Any] | None,
                   output_schema: dict[str, Any] | None) -> None:
    """What serves a version fits its model's kind: a handler class only for kind `handler` (and
    required there), declared schemas only where the kind does not fix them (and required for
    `torch-export`, whose tensors they describe)."""
    if kind is ModelKind.handler:
        if handler is None:
            raise BadRequest("a version of a 'handler' model names its class: \"handler\": \"package.module:Class\"")
        try:
            check_spec(handler)
        except ModelError as exc:
            raise InvalidInput(str(exc)) from None
    elif handler is not None:
        raise BadRequest(f"'handler' is for models of kind 'handler'; this model is '{kind}'")
    if kind in SCHEMA_KINDS:
        if kind is ModelKind.torch_export and (input_schema is None or output_schema is None):
            raise BadRequest("a 'torch-export' version declares input_schema and output_schema: the program's "
                             "tensors, one property each, in order")
        if input_schema is not None:
            check_declared_schema(input_schema, what="input_schema")
        if output_schema is not None:
            check_declared_schema(output_schema, what="output_schema")
    elif input_schema is not None or output_schema is not None:
        raise BadRequest(f"kind '{kind}' fixes its schemas; input_schema and output_schema are for "
                         f"{' and '.join(sorted(SCHEMA_KINDS))} models")


def _check_allow_pickle(kind: ModelKind, allow_pickle: bool) -> None:
    """Only a torch-export archive is ever unpickled with code allowed; the other kinds refuse
    pickles whatever the version says, so the flag would promise what it does not do."""
    if allow_pickle and kind is not ModelKind.torch_export:
        raise BadRequest(f"allow_pickle is for models of kind 'torch-export'; this model is '{kind}'")


def _check_cache_ttl(cache_ttl_s: int) -> None:
    if not 0 <= cache_ttl_s <= MAX_TTL_S:
        raise BadRequest(f"cache_ttl_s must be between 0 (no response cache) and {MAX_TTL_S}")


def _check_job_limits(*, max_queue_s: float | None, run_timeout_s: float | None,
                      batch_timeout_s: float | None) -> None:
    """A version's defaults for its jobs' limits stay within what a job may ask for itself
    (api/routes/jobs.py); `batch_timeout_s`: the server's per-batch timeout, None where unknown."""
    if max_queue_s is not None and not 0 < max_queue_s <= MAX_QUEUE_S:
        raise InvalidInput(f"max_queue_s must be more than 0 and at most {MAX_QUEUE_S} (7 days), or null for none")
    if run_timeout_s is not None:
        if run_timeout_s <= 0:
            raise InvalidInput("run_timeout_s must be more than 0, or null for none")
        if batch_timeout_s is not None and run_timeout_s > batch_timeout_s:
            raise InvalidInput(f"run_timeout_s must be at most {batch_timeout_s:g}, this server's per-batch "
                               "timeout (SLUICE_BATCH_TIMEOUT_S)")


def get_version(session: Session, model: str, version: str) -> ModelVersion:
    row = session.get(ModelVersion, (model, version))
    if row is None:
        raise NotFound(f"model '{model}' has no version '{version}'")
    return row


def record_version_error(session: Session, *, model: str, version: str, message: str | None) -> None:
    row = session.get(ModelVersion, (model, version))
    if row is not None:
        row.last_error = message


def routing_weights(session: Session, model: str) -> dict[str, float]:
    """The model's routing weights by version, as its resource shows them."""
    rows = session.scalars(select(RoutingWeight).where(RoutingWeight.model == model))
    return {row.version: row.weight for row in rows}


def version_resource(row: ModelVersion) -> dict[str, Any]:
    return {
        "version": row.version,
        "state": row.state,
        "artifact": row.artifact,
        "sha256": row.sha256,
        "batching": {
            "max_batch_size": row.max_batch_size,
            "max_wait_ms": row.max_wait_ms,
            "isolate_tenants": row.isolate_tenants,
            "p99_budget_ms": row.p99_budget_ms,
            "auto_tune": row.auto_tune,
            "tuned_at": row.tuned_at.isoformat() if row.tuned_at else None,
            "tuned_on": row.tuned_on,
            "proposal": row.tune_proposal,
        },
        "min_replicas": row.min_replicas,
        "max_replicas": row.max_replicas,
        "cache_ttl_s": row.cache_ttl_s,
        "max_queue_s": row.max_queue_s,
        "run_timeout_s": row.run_timeout_s,
        "last_error": row.last_error,
        "handler": row.handler,
        "input_schema": row.input_schema,
        "output_schema": row.output_schema,
        "allow_pickle": row.allow_pickle,
    }


def model_resource(session: Session, name: str) -> dict[str, Any]:
    model = session.get(Model, name)
    if model is None:
        raise NotFound(f"model '{name}' does not exist")
    return {
        "name": model.name,
        "kind": model.kind,
        "tier": model.tier,
        "versions": [version_resource(v) for v in model.versions],
        "routing": routing_weights(session, name),
    }


def list_models(session: Session) -> list[dict[str, Any]]:
    return [model_resource(session, name) for name in session.scalars(select(Model.name).order_by(Model.name))]


def update_version(
    session: Session, *, model: str, version: str, actor: str, reason: str | None, state: str | None = None,
    max_batch_size: int | None = None, max_wait_ms: float | None = None, isolate_tenants: bool | None = None,
    min_replicas: int | None = None, max_replicas: int | None = None, cache_ttl_s: int | None = None,
    allow_pickle: bool | None = None, job_limits: Mapping[str, float | None] | None = None,
    batch_timeout_s: float | None = None, tuning: Mapping[str, Any] | None = None,
    tuned: tuple[datetime, Mapping[str, Any]] | None = None,
) -> tuple[ModelVersion, AuditEntry]:
    """Change a version's state, batching, replicas, response-cache TTL, pickle opt-in, its jobs'
    default limits (`job_limits`: `max_queue_s` and `run_timeout_s` as given, None clearing one) or
    its tuning (`tuning`: `p99_budget_ms`, None clearing it, and `auto_tune`; `tuned`: when and on
    what the new batching was tuned, from `sluice.registry.tuning.apply_proposal`).
    Retiring also takes its routing weight away. A new allow_pickle takes effect when a worker next
    loads it."""
    row = get_version(session, model, version)
    if allow_pickle is not None:
        _check_allow_pickle(ModelKind(row.model_row.kind), allow_pickle)
    before = version_resource(row)
    if state is not None:
        if state not in tuple(VersionState):
            raise BadRequest(f"state must be one of {', '.join(VersionState)}")
        if state != row.state:
            row.retired_at = datetime.now(UTC) if state == VersionState.retired else None
        row.state = state
        if state == VersionState.retired:
            session.execute(delete(RoutingWeight).where(RoutingWeight.model == model,
                                                        RoutingWeight.version == version))
            session.execute(delete(Pin).where(Pin.model == model, Pin.version == version))
    for name, value in (("max_batch_size", max_batch_size), ("max_wait_ms", max_wait_ms),
                        ("isolate_tenants", isolate_tenants), ("min_replicas", min_replicas),
                        ("max_replicas", max_replicas), ("cache_ttl_s", cache_ttl_s),
                        ("allow_pickle", allow_pickle)):
        if value is not None:
            setattr(row, name, value)
    limits = job_limits or {}
    _check_job_limits(max_queue_s=limits.get("max_queue_s"), run_timeout_s=limits.get("run_timeout_s"),
                      batch_timeout_s=batch_timeout_s)
    for name in ("max_queue_s", "run_timeout_s"):
        if name in limits:
            setattr(row, name, limits[name])
    for name in ("p99_budget_ms", "auto_tune"):
        if tuning and name in tuning:
            setattr(row, name, tuning[name])
    if tuned is not None:
        row.tuned_at, row.tuned_on = tuned[0], dict(tuned[1])
    if row.p99_budget_ms is not None and row.p99_budget_ms <= 0:
        raise BadRequest("p99_budget_ms must be > 0")
    if row.max_replicas < row.min_replicas:
        raise BadRequest("max_replicas must be >= min_replicas")
    _check_cache_ttl(row.cache_ttl_s)
    session.flush()
    entry = audit.record(session, actor=actor, action="version.update", model=model, before=before,
                   after=version_resource(row), reason=reason)
    return row, entry
