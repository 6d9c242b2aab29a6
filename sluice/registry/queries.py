"""Plain query functions over a Session: one function per thing the platform asks or changes.

Every change to routing or pins writes one audit row in the same transaction, so the audit log
can never disagree with the table it describes.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from sluice.errors import BadRequest, Conflict, InvalidInput, ModelError, NotFound
from sluice.handler import check_spec
from sluice.kinds import SCHEMA_KINDS, ModelKind, check_declared_schema, schema_text
from sluice.registry.tables import (
    ApiKey,
    AuditEntry,
    Model,
    ModelVersion,
    Pin,
    Rollout,
    RoutingWeight,
    Tenant,
)
from sluice.routing import ModelInfo, RoutingSnapshot, VersionInfo
from sluice.versions import Tier, VersionState
from sluice.wire.response_cache import MAX_TTL_S

KEY_PREFIX = "sk"


@dataclass(frozen=True, slots=True)
class KeyInfo:
    key_id: str
    tenant: str
    is_admin: bool
    rate_limit_per_s: float = 200.0
    rate_burst: int = 2000
    max_queued: int = 100_000


@dataclass(frozen=True, slots=True)
class IssuedKey:
    key_id: str
    secret: str  # shown once, never stored


def hash_key(raw_key: str) -> str:
    # Keys carry 192 random bits, so a fast hash is as safe as a slow one and keeps auth cheap.
    return hashlib.sha256(raw_key.encode()).hexdigest()


def _new_key(session: Session, tenant_id: str, *, is_admin: bool, raw: str | None = None) -> IssuedKey:
    key_id = secrets.token_hex(6)
    secret = raw or f"{KEY_PREFIX}_{key_id}_{secrets.token_urlsafe(24)}"
    session.add(ApiKey(id=key_id, tenant_id=tenant_id, key_hash=hash_key(secret), is_admin=is_admin))
    return IssuedKey(key_id=key_id, secret=secret)


def _audit(
    session: Session, *, actor: str, action: str, model: str | None, before: Any, after: Any, reason: str | None
) -> AuditEntry:
    entry = AuditEntry(actor=actor, action=action, model=model, before=before, after=after, reason=reason)
    session.add(entry)
    session.flush()
    return entry


def audit_resource(entry: AuditEntry) -> dict[str, Any]:
    return {
        "id": entry.id,
        "at": (entry.at or datetime.now(UTC)).isoformat(),
        "actor": entry.actor,
        "action": entry.action,
        "model": entry.model,
        "before": entry.before,
        "after": entry.after,
        "reason": entry.reason,
    }


def audit_entries(session: Session, model: str, *, limit: int, before_id: int | None = None) -> list[AuditEntry]:
    """The model's audit log, newest first; `before_id` pages back from an entry."""
    if session.get(Model, model) is None:
        raise NotFound(f"model '{model}' does not exist")
    query = select(AuditEntry).where(AuditEntry.model == model)
    if before_id is not None:
        query = query.where(AuditEntry.id < before_id)
    return list(session.scalars(query.order_by(AuditEntry.id.desc()).limit(limit)))


# --- tenants and keys ---------------------------------------------------------------------------


def create_tenant(
    session: Session,
    *,
    tenant_id: str,
    actor: str,
    is_admin: bool = False,
    rate_limit_per_s: float = 200.0,
    max_queued: int = 100_000,
) -> tuple[Tenant, IssuedKey]:
    if session.get(Tenant, tenant_id) is not None:
        raise Conflict(f"tenant '{tenant_id}' already exists")
    tenant = Tenant(
        id=tenant_id,
        webhook_secret=secrets.token_urlsafe(32),
        rate_limit_per_s=rate_limit_per_s,
        rate_burst=max(1, int(rate_limit_per_s * 10)),
        max_queued=max_queued,
    )
    session.add(tenant)
    session.flush()
    key = _new_key(session, tenant_id, is_admin=is_admin)
    _audit(session, actor=actor, action="tenant.create", model=None, before=None,
           after={"tenant": tenant_id, "key_id": key.key_id, "admin": is_admin}, reason=None)
    return tenant, key


def ensure_tenant_key(session: Session, *, tenant_id: str, raw_key: str, is_admin: bool) -> None:
    """Idempotent seeding: make `raw_key` a valid key of `tenant_id` (created if missing)."""
    if session.get(Tenant, tenant_id) is None:
        session.add(Tenant(id=tenant_id, webhook_secret=secrets.token_urlsafe(32)))
        session.flush()
    existing = session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(raw_key)))
    if existing is None:
        _new_key(session, tenant_id, is_admin=is_admin, raw=raw_key)
    elif existing.revoked_at is not None or existing.is_admin != is_admin:
        existing.revoked_at = None
        existing.is_admin = is_admin


def issue_key(session: Session, *, tenant_id: str, actor: str, is_admin: bool = False) -> IssuedKey:
    if session.get(Tenant, tenant_id) is None:
        raise NotFound(f"tenant '{tenant_id}' does not exist")
    key = _new_key(session, tenant_id, is_admin=is_admin)
    _audit(session, actor=actor, action="key.issue", model=None, before=None,
           after={"tenant": tenant_id, "key_id": key.key_id, "admin": is_admin}, reason=None)
    return key


def revoke_key(session: Session, *, key_id: str, actor: str) -> str:
    key = session.get(ApiKey, key_id)
    if key is None or key.revoked_at is not None:
        raise NotFound(f"key '{key_id}' does not exist")
    key.revoked_at = datetime.now(UTC)
    _audit(session, actor=actor, action="key.revoke", model=None,
           before={"key_id": key_id}, after=None, reason=None)
    return key.key_hash


def lookup_key(session: Session, raw_key: str) -> KeyInfo | None:
    found = session.execute(
        select(ApiKey, Tenant)
        .join(Tenant, Tenant.id == ApiKey.tenant_id)
        .where(ApiKey.key_hash == hash_key(raw_key), ApiKey.revoked_at.is_(None))
    ).first()
    if found is None:
        return None
    key, tenant = found
    return KeyInfo(key_id=key.id, tenant=key.tenant_id, is_admin=key.is_admin,
                   rate_limit_per_s=tenant.rate_limit_per_s, rate_burst=tenant.rate_burst,
                   max_queued=tenant.max_queued)


def tenant_secret(session: Session, tenant_id: str) -> str | None:
    tenant = session.get(Tenant, tenant_id)
    return tenant.webhook_secret if tenant else None


# --- models and versions ------------------------------------------------------------------------


def create_model(session: Session, *, name: str, kind: str, actor: str, tier: str = Tier.latency) -> Model:
    if session.get(Model, name) is not None:
        raise Conflict(f"model '{name}' already exists")
    if tier not in tuple(Tier):
        raise BadRequest(f"tier must be one of {', '.join(Tier)}")
    model = Model(name=name, kind=kind, tier=tier)
    session.add(model)
    session.flush()
    _audit(session, actor=actor, action="model.create", model=name, before=None,
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
    return _audit(session, actor=actor, action="model.tier", model=model, before={"tier": before},
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
    handler: str | None = None,
    input_schema: dict[str, Any] | None = None,
    output_schema: dict[str, Any] | None = None,
) -> ModelVersion:
    model_row = session.get(Model, model)
    if model_row is None:
        raise NotFound(f"model '{model}' does not exist")
    _check_serving(ModelKind(model_row.kind), handler=handler, input_schema=input_schema, output_schema=output_schema)
    if session.get(ModelVersion, (model, version)) is not None:
        raise Conflict(f"model '{model}' already has a version '{version}'")
    if state not in tuple(VersionState):
        raise BadRequest(f"state must be one of {', '.join(VersionState)}")
    if max_replicas < min_replicas:
        raise BadRequest("max_replicas must be >= min_replicas")
    _check_cache_ttl(cache_ttl_s)
    row = ModelVersion(
        model=model, version=version, artifact=artifact, sha256=sha256.lower(), state=state,
        max_batch_size=max_batch_size, max_wait_ms=max_wait_ms, isolate_tenants=isolate_tenants,
        min_replicas=min_replicas, max_replicas=max_replicas, cache_ttl_s=cache_ttl_s,
        handler=handler, input_schema=input_schema, output_schema=output_schema,
    )
    session.add(row)
    session.flush()
    after = {"version": version, "artifact": artifact, "sha256": sha256, "state": state}
    if handler is not None:
        after["handler"] = handler
    _audit(session, actor=actor, action="version.register", model=model, before=None, after=after, reason=None)
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


def _check_cache_ttl(cache_ttl_s: int) -> None:
    if not 0 <= cache_ttl_s <= MAX_TTL_S:
        raise BadRequest(f"cache_ttl_s must be between 0 (no response cache) and {MAX_TTL_S}")


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
    rows = session.scalars(select(RoutingWeight).where(RoutingWeight.model == model))
    return {row.version: row.weight for row in rows}


def set_routing(
    session: Session, *, model: str, weights: dict[str, float], actor: str, reason: str | None
) -> AuditEntry:
    known = {v.version: v for v in session.scalars(select(ModelVersion).where(ModelVersion.model == model))}
    if session.get(Model, model) is None:
        raise NotFound(f"model '{model}' does not exist")
    for version, weight in weights.items():
        if version not in known:
            raise NotFound(f"model '{model}' has no version '{version}'")
        if weight < 0:
            raise BadRequest("routing weights must be >= 0")
        if weight > 0 and known[version].state == VersionState.retired:
            raise Conflict(f"version '{version}' is retired and cannot take traffic")
    if weights and sum(weights.values()) <= 0:
        raise BadRequest("at least one routing weight must be positive")
    before = routing_weights(session, model)
    session.execute(delete(RoutingWeight).where(RoutingWeight.model == model))
    for version, weight in weights.items():
        if weight > 0:
            session.add(RoutingWeight(model=model, version=version, weight=float(weight)))
    after = {v: float(w) for v, w in weights.items() if w > 0}
    return _audit(session, actor=actor, action="routing.set", model=model, before=before, after=after,
                  reason=reason)


def set_pin(session: Session, *, tenant_id: str, model: str, version: str, actor: str) -> AuditEntry:
    if session.get(Tenant, tenant_id) is None:
        raise NotFound(f"tenant '{tenant_id}' does not exist")
    row = get_version(session, model, version)
    if row.state == VersionState.retired:
        raise Conflict(f"version '{version}' is retired")
    pin = session.get(Pin, (tenant_id, model))
    before = pin.version if pin else None
    if pin is None:
        session.add(Pin(tenant_id=tenant_id, model=model, version=version))
    else:
        pin.version = version
    return _audit(session, actor=actor, action="pin.set", model=model,
                  before={"tenant": tenant_id, "version": before},
                  after={"tenant": tenant_id, "version": version}, reason=None)


def delete_pin(session: Session, *, tenant_id: str, model: str, actor: str) -> AuditEntry:
    pin = session.get(Pin, (tenant_id, model))
    if pin is None:
        raise NotFound(f"tenant '{tenant_id}' has no pin on '{model}'")
    before = pin.version
    session.delete(pin)
    return _audit(session, actor=actor, action="pin.delete", model=model,
                  before={"tenant": tenant_id, "version": before}, after=None, reason=None)


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
        },
        "min_replicas": row.min_replicas,
        "max_replicas": row.max_replicas,
        "cache_ttl_s": row.cache_ttl_s,
        "last_error": row.last_error,
        "handler": row.handler,
        "input_schema": row.input_schema,
        "output_schema": row.output_schema,
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


def _version_info(row: ModelVersion) -> VersionInfo:
    return VersionInfo(
        model=row.model, version=row.version, state=row.state, artifact=row.artifact, sha256=row.sha256,
        max_batch_size=row.max_batch_size, max_wait_ms=row.max_wait_ms,
        isolate_tenants=row.isolate_tenants, min_replicas=row.min_replicas,
        max_replicas=row.max_replicas, latency_budget_ms=row.latency_budget_ms, cache_ttl_s=row.cache_ttl_s,
        handler=row.handler, input_schema=None if row.input_schema is None else schema_text(row.input_schema),
    )


def routing_snapshot(session: Session) -> RoutingSnapshot:
    """Everything routing needs, in one read, for the API's cache and the scheduler."""
    rows = {m.name: m for m in session.scalars(select(Model))}
    kinds = {name: m.kind for name, m in rows.items()}
    versions: dict[str, dict[str, VersionInfo]] = {name: {} for name in kinds}
    for row in session.scalars(select(ModelVersion)):
        versions[row.model][row.version] = _version_info(row)
    weights: dict[str, dict[str, float]] = {name: {} for name in kinds}
    for w in session.scalars(select(RoutingWeight)):
        weights[w.model][w.version] = w.weight
    pins = {(p.tenant_id, p.model): p.version for p in session.scalars(select(Pin))}
    return RoutingSnapshot(
        models={
            name: ModelInfo(name=name, kind=kind, versions=versions[name], weights=weights[name],
                            tier=rows[name].tier)
            for name, kind in kinds.items()
        },
        pins=pins,
    )


def update_version(
    session: Session, *, model: str, version: str, actor: str, reason: str | None, state: str | None = None,
    max_batch_size: int | None = None, max_wait_ms: float | None = None, isolate_tenants: bool | None = None,
    min_replicas: int | None = None, max_replicas: int | None = None, cache_ttl_s: int | None = None,
) -> tuple[ModelVersion, AuditEntry]:
    """Change a version's state, batching, replicas or response-cache TTL. Retiring also takes its
    routing weight away."""
    row = get_version(session, model, version)
    before = version_resource(row)
    if state is not None:
        if state not in tuple(VersionState):
            raise BadRequest(f"state must be one of {', '.join(VersionState)}")
        row.state = state
        if state == VersionState.retired:
            session.execute(delete(RoutingWeight).where(RoutingWeight.model == model,
                                                        RoutingWeight.version == version))
            session.execute(delete(Pin).where(Pin.model == model, Pin.version == version))
    for name, value in (("max_batch_size", max_batch_size), ("max_wait_ms", max_wait_ms),
                        ("isolate_tenants", isolate_tenants), ("min_replicas", min_replicas),
                        ("max_replicas", max_replicas), ("cache_ttl_s", cache_ttl_s)):
        if value is not None:
            setattr(row, name, value)
    if row.max_replicas < row.min_replicas:
        raise BadRequest("max_replicas must be >= min_replicas")
    _check_cache_ttl(row.cache_ttl_s)
    session.flush()
    entry = _audit(session, actor=actor, action="version.update", model=model, before=before,
                   after=version_resource(row), reason=reason)
    return row, entry


def _completed_rollout(session: Session, model: str) -> Rollout | None:
    """The model's latest rollout if it promoted its canary and that version is still stable."""
    latest = session.scalars(select(Rollout).where(Rollout.model == model).order_by(Rollout.id.desc())).first()
    if latest is None or latest.state != "promoted":
        return None
    return latest if get_version(session, model, latest.canary).state == VersionState.stable else None


def _last_promoted_stable(session: Session, model: str) -> ModelVersion:
    row = session.scalars(
        select(ModelVersion)
        .where(ModelVersion.model == model, ModelVersion.state == VersionState.stable)
        .order_by(ModelVersion.updated_at.desc())
    ).first()
    if row is None:
        raise Conflict(f"model '{model}' has no stable version to roll back to")
    return row


def rollback(session: Session, *, model: str, actor: str, reason: str | None) -> AuditEntry:
    """All unpinned traffic back to the last stable version, in one audited change.

    After a completed rollout that is the version the rollout replaced: the one it promoted is
    then the most recently changed stable version, and the one being rolled back, so it goes to
    `staged` as a rolled-back canary does (audited too). Otherwise it is the most recently
    promoted stable version. Shadow sample rates are kept: a rollback moves traffic, it does not
    stop a comparison."""
    why = reason or "rollback"
    undone = _completed_rollout(session, model)
    if undone is None:
        stable = _last_promoted_stable(session, model)
    else:
        stable = get_version(session, model, undone.stable)
        if stable.state == VersionState.retired:
            raise Conflict(f"'{stable.version}', which rollout {undone.id} replaced, is retired: set the routing "
                           "weights instead")
        update_version(session, model=model, version=undone.canary, actor=actor, state=VersionState.staged,
                       reason=f"{why}: back from '{undone.canary}', which rollout {undone.id} promoted")
        if stable.state != VersionState.stable:
            update_version(session, model=model, version=stable.version, actor=actor, state=VersionState.stable,
                           reason=f"{why}: back to '{stable.version}', which rollout {undone.id} replaced")
    shadows = {v.version for v in session.scalars(
        select(ModelVersion).where(ModelVersion.model == model, ModelVersion.state == VersionState.shadow))}
    weights = {v: w for v, w in routing_weights(session, model).items() if v in shadows}
    weights[stable.version] = 100.0
    return set_routing(session, model=model, weights=weights, actor=actor, reason=why)
