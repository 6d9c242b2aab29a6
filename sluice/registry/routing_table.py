"""Who gets which version: routing weights, tenant pins, the routing snapshot the API caches, and
rollback. Every change writes its audit row in the same transaction."""

from __future__ import annotations

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from sluice.errors import BadRequest, Conflict, NotFound
from sluice.kinds import schema_text
from sluice.registry import audit, catalog
from sluice.registry.tables import (
    AuditEntry,
    Model,
    ModelVersion,
    Pin,
    Rollout,
    RoutingWeight,
    Tenant,
)
from sluice.routing import ModelInfo, RoutingSnapshot, VersionInfo
from sluice.versions import VersionState


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
    before = catalog.routing_weights(session, model)
    session.execute(delete(RoutingWeight).where(RoutingWeight.model == model))
    for version, weight in weights.items():
        if weight > 0:
            session.add(RoutingWeight(model=model, version=version, weight=float(weight)))
    after = {v: float(w) for v, w in weights.items() if w > 0}
    return audit.record(session, actor=actor, action="routing.set", model=model, before=before, after=after,
                  reason=reason)


def set_pin(session: Session, *, tenant_id: str, model: str, version: str, actor: str) -> AuditEntry:
    if session.get(Tenant, tenant_id) is None:
        raise NotFound(f"tenant '{tenant_id}' does not exist")
    row = catalog.get_version(session, model, version)
    if row.state == VersionState.retired:
        raise Conflict(f"version '{version}' is retired")
    pin = session.get(Pin, (tenant_id, model))
    before = pin.version if pin else None
    if pin is None:
        session.add(Pin(tenant_id=tenant_id, model=model, version=version))
    else:
        pin.version = version
    return audit.record(session, actor=actor, action="pin.set", model=model,
                  before={"tenant": tenant_id, "version": before},
                  after={"tenant": tenant_id, "version": version}, reason=None)


def delete_pin(session: Session, *, tenant_id: str, model: str, actor: str) -> AuditEntry:
    pin = session.get(Pin, (tenant_id, model))
    if pin is None:
        raise NotFound(f"tenant '{tenant_id}' has no pin on '{model}'")
    before = pin.version
    session.delete(pin)
    return audit.record(session, actor=actor, action="pin.delete", model=model,
                  before={"tenant": tenant_id, "version": before}, after=None, reason=None)


def _version_info(row: ModelVersion) -> VersionInfo:
    return VersionInfo(
        model=row.model, version=row.version, state=row.state, artifact=row.artifact, sha256=row.sha256,
        max_batch_size=row.max_batch_size, max_wait_ms=row.max_wait_ms,
        isolate_tenants=row.isolate_tenants, min_replicas=row.min_replicas,
        max_replicas=row.max_replicas, latency_budget_ms=row.latency_budget_ms, cache_ttl_s=row.cache_ttl_s,
        handler=row.handler, input_schema=None if row.input_schema is None else schema_text(row.input_schema),
        retired_at=None if row.retired_at is None else row.retired_at.timestamp(),
        max_queue_s=row.max_queue_s, run_timeout_s=row.run_timeout_s,
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


def _completed_rollout(session: Session, model: str) -> Rollout | None:
    """The model's latest rollout if it promoted its canary and that version is still stable."""
    latest = session.scalars(select(Rollout).where(Rollout.model == model).order_by(Rollout.id.desc())).first()
    if latest is None or latest.state != "promoted":
        return None
    return latest if catalog.get_version(session, model, latest.canary).state == VersionState.stable else None


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
        stable = catalog.get_version(session, model, undone.stable)
        if stable.state == VersionState.retired:
            raise Conflict(f"'{stable.version}', which rollout {undone.id} replaced, is retired: set the routing "
                           "weights instead")
        catalog.update_version(session, model=model, version=undone.canary, actor=actor, state=VersionState.staged,
                       reason=f"{why}: back from '{undone.canary}', which rollout {undone.id} promoted")
        if stable.state != VersionState.stable:
            catalog.update_version(session, model=model, version=stable.version, actor=actor, state=VersionState.stable,
                           reason=f"{why}: back to '{stable.version}', which rollout {undone.id} replaced")
    shadows = {v.version for v in session.scalars(
        select(ModelVersion).where(ModelVersion.model == model, ModelVersion.state == VersionState.shadow))}
    weights = {v: w for v, w in catalog.routing_weights(session, model).items() if v in shadows}
    weights[stable.version] = 100.0
    return set_routing(session, model=model, weights=weights, actor=actor, reason=why)
