"""Rollouts in the registry: start, apply a decision, abort, and read them back.

Every weight change goes through `routing_table.set_routing` and every state change through
`catalog.update_version`, so a rollout's changes land in the same audit log as an admin's, in
the same transaction as the decision row that caused them. While a rollout runs it owns the
model's weights: `{stable: 100 - w, canary: w}` at each step, other versions at 0. A canary in
state `shadow` starts in a shadow phase (step -1) where its weight is, as always for a shadow
version, the percentage of stable's jobs copied to it, so it must already have one. Abort puts
back the weights and the canary's state from before the start; rollback gives a canary's share
back to stable (a shadow percentage is no share: it just goes) and sets the canary to `staged`
with no weight, so it neither serves nor receives shadow copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from sluice.errors import BadRequest, Conflict, NotFound
from sluice.registry import catalog, routing_table
from sluice.registry.tables import AuditEntry, Model, ModelVersion, Rollout, RolloutDecision
from sluice.versions import PRIMARY_STATES, VersionState

SHADOW_STEP = -1  # the step index of the phase before any canary weight: the candidate sees shadow copies


@dataclass(frozen=True, slots=True)
class Applied:
    """What a decision changed; `routing_changed` says the change must be announced."""

    decision_id: int
    routing_changed: bool
    state: str
    step_index: int


def step_weight(rollout: Rollout, step: int) -> float:
    return 0.0 if step == SHADOW_STEP else float(rollout.policy["steps"][step])


def _step_weights(rollout: Rollout, step: int) -> dict[str, float]:
    weight = step_weight(rollout, step)
    return {rollout.stable: 100.0 - weight, rollout.canary: weight}


def _default_stable(session: Session, model: str, canary: str) -> str:
    """The most heavily weighted other serving version, else the last promoted stable one."""
    weights = catalog.routing_weights(session, model)
    states = {row.version: row.state for row in session.scalars(select(ModelVersion)
                                                                .where(ModelVersion.model == model))}
    others = sorted(((w, v) for v, w in weights.items()
                     if v != canary and w > 0 and states.get(v) in PRIMARY_STATES), reverse=True)
    if others:
        return others[0][1]
    row = session.scalars(
        select(ModelVersion)
        .where(ModelVersion.model == model, ModelVersion.state == VersionState.stable, ModelVersion.version != canary)
        .order_by(ModelVersion.updated_at.desc())
    ).first()
    if row is None:
        raise Conflict(f"model '{model}' has no stable version to compare '{canary}' with")
    return row.version


def _record(session: Session, rollout: Rollout, *, at: datetime, action: str, reason: str,
            evidence: dict[str, Any], audit: AuditEntry | None) -> RolloutDecision:
    row = RolloutDecision(rollout_id=rollout.id, at=at, step_index=rollout.step_index, action=action,
                          reason=reason, evidence=evidence, audit_id=audit.id if audit else None)
    session.add(row)
    session.flush()
    return row


def start_rollout(session: Session, *, model: str, canary: str, policy: dict[str, Any], actor: str,
                  now: datetime, stable: str | None = None, reason: str | None = None) -> Rollout:
    """Start at the first step, or in the shadow phase when the canary is in state `shadow`.
    `reason` (the operator's why) goes into the start decision and its audit row."""
    if session.scalar(select(Rollout.id).where(Rollout.model == model, Rollout.state == "running")):
        raise Conflict(f"model '{model}' already has a running rollout")
    candidate = catalog.get_version(session, model, canary)
    stable = stable or _default_stable(session, model, canary)
    baseline = catalog.get_version(session, model, stable)
    if stable == canary:
        raise BadRequest("the canary and the stable version must differ")
    for row in (candidate, baseline):
        if row.state == VersionState.retired:
            raise Conflict(f"version '{row.version}' is retired")
    step = SHADOW_STEP if candidate.state == VersionState.shadow else 0
    if step == SHADOW_STEP and (baseline.state != VersionState.stable
                                or not catalog.routing_weights(session, model).get(canary)):
        raise BadRequest(f"a shadow phase needs '{stable}' in state stable and a weight on '{canary}' (the "
                         "percentage of stable's jobs copied to it)")
    rollout = Rollout(model=model, canary=canary, stable=stable, policy=policy,
                      initial_weights=catalog.routing_weights(session, model),
                      canary_initial_state=candidate.state, step_index=step, state="running", actor=actor,
                      started_at=now, step_started_at=now)
    session.add(rollout)
    session.flush()
    why = f": {reason}" if reason else ""
    audit = None
    if step != SHADOW_STEP:
        if candidate.state != VersionState.canary:
            catalog.update_version(session, model=model, version=canary, actor=actor, state=VersionState.canary,
                                   reason=f"rollout {rollout.id} started{why}")
        audit = routing_table.set_routing(session, model=model, weights=_step_weights(rollout, step), actor=actor,
                                    reason=f"rollout {rollout.id}: canary '{canary}' at "
                                           f"{step_weight(rollout, step):g} %{why}")
    _record(session, rollout, at=now, action="start", audit=audit, evidence={"policy": policy},
            reason=f"canary '{canary}' against stable '{stable}'"
                   + (" (shadow phase first)" if step == SHADOW_STEP else "") + why)
    return rollout


def running_rollouts(session: Session) -> list[Rollout]:
    return list(session.scalars(select(Rollout).where(Rollout.state == "running").order_by(Rollout.id)))


def recent_rollouts(session: Session, model: str, *, limit: int) -> list[Rollout]:
    """The model's latest `limit` rollouts, newest first."""
    return list(session.scalars(select(Rollout).where(Rollout.model == model).order_by(Rollout.id.desc())
                                .limit(limit)))


def latest_rollout(session: Session, model: str) -> Rollout:
    row = session.scalars(select(Rollout).where(Rollout.model == model).order_by(Rollout.id.desc())).first()
    if row is None:
        raise NotFound(f"model '{model}' has no rollout")
    return row


def decisions(session: Session, rollout_id: int, *, limit: int = 20) -> list[RolloutDecision]:
    """The latest `limit` decisions, oldest first."""
    rows = session.scalars(select(RolloutDecision).where(RolloutDecision.rollout_id == rollout_id)
                           .order_by(RolloutDecision.id.desc()).limit(limit))
    return list(reversed(list(rows)))


def _finish(rollout: Rollout, *, state: str, now: datetime, reason: str) -> None:
    rollout.state, rollout.finished_at, rollout.reason = state, now, reason


def apply_decision(session: Session, *, rollout_id: int, expected_step: int, action: str, reason: str,
                   evidence: dict[str, Any], actor: str, now: datetime, to_step: int | None = None,
                   final: bool = False) -> Applied | None:
    """Record a decision taken at `expected_step` and make its change, in one transaction.

    Answers None when the rollout has moved on meanwhile (aborted, or another controller acted):
    the row lock makes the check and the change one step, so a stale decision is dropped."""
    rollout = session.get(Rollout, rollout_id, with_for_update=True)
    if rollout is None or rollout.state != "running" or rollout.step_index != expected_step:
        return None
    audit = None
    if action == "promote":
        if to_step is None or not 0 <= to_step < len(rollout.policy["steps"]):
            raise BadRequest(f"no step {to_step} to promote to")
        if final:
            audit = routing_table.set_routing(session, model=rollout.model, weights={rollout.canary: 100.0},
                                              actor=actor,
                                              reason=f"rollout {rollout.id}: '{rollout.canary}' promoted to stable")
            catalog.update_version(session, model=rollout.model, version=rollout.canary, actor=actor,
                                   state=VersionState.stable, reason=f"rollout {rollout.id} promoted")
        else:
            if rollout.step_index == SHADOW_STEP:
                catalog.update_version(session, model=rollout.model, version=rollout.canary, actor=actor,
                                       state=VersionState.canary, reason=f"rollout {rollout.id}: shadow phase passed")
            audit = routing_table.set_routing(session, model=rollout.model, weights=_step_weights(rollout, to_step),
                                        actor=actor, reason=f"rollout {rollout.id}: canary '{rollout.canary}' "
                                                            f"to {step_weight(rollout, to_step):g} %")
    elif action == "rollback":
        audit = routing_table.set_routing(session, model=rollout.model, weights=_rollback_weights(rollout),
                                    actor=actor, reason=f"rollout {rollout.id} rolled back: {reason}")
        catalog.update_version(session, model=rollout.model, version=rollout.canary, actor=actor,
                               state=VersionState.staged, reason=f"rollout {rollout.id} rolled back")
    elif action != "continue":
        raise BadRequest(f"unknown rollout action '{action}'")
    row = _record(session, rollout, at=now, action=action, reason=reason, evidence=evidence, audit=audit)
    if action == "promote" and to_step is not None:
        if final:
            _finish(rollout, state="promoted", now=now, reason=reason)
        rollout.step_index, rollout.step_started_at = to_step, now
    elif action == "rollback":
        _finish(rollout, state="rolled_back", now=now, reason=reason)
    return Applied(decision_id=row.id, routing_changed=audit is not None, state=rollout.state,
                   step_index=rollout.step_index)


def _rollback_weights(rollout: Rollout) -> dict[str, float]:
    weights = {v: float(w) for v, w in rollout.initial_weights.items()}
    share = weights.pop(rollout.canary, 0.0) if rollout.canary_initial_state != VersionState.shadow else 0.0
    weights[rollout.stable] = weights.get(rollout.stable, 0.0) + share
    weights[rollout.canary] = 0.0
    return weights if sum(weights.values()) > 0 else {rollout.stable: 100.0, rollout.canary: 0.0}


def abort_rollout(session: Session, *, model: str, actor: str, now: datetime, reason: str | None = None) -> Rollout:
    """Stop the running rollout and put the weights and the canary's state back as they were."""
    rollout = session.scalars(select(Rollout).where(Rollout.model == model, Rollout.state == "running")
                              .with_for_update()).first()
    if rollout is None:
        if session.get(Model, model) is None:
            raise NotFound(f"model '{model}' does not exist")
        raise Conflict(f"model '{model}' has no running rollout")
    why = reason or "aborted by an operator"
    weights = {v: float(w) for v, w in rollout.initial_weights.items()}
    audit = routing_table.set_routing(session, model=model, weights=weights, actor=actor,
                                reason=f"rollout {rollout.id} aborted: {why}")
    if catalog.get_version(session, model, rollout.canary).state != rollout.canary_initial_state:
        catalog.update_version(session, model=model, version=rollout.canary, actor=actor,
                               state=rollout.canary_initial_state, reason=f"rollout {rollout.id} aborted")
    _record(session, rollout, at=now, action="abort", reason=why, evidence={"restored_weights": weights},
            audit=audit)
    _finish(rollout, state="aborted", now=now, reason=why)
    return rollout


def rollout_resource(rollout: Rollout, history: list[RolloutDecision]) -> dict[str, Any]:
    return {
        "id": rollout.id,
        "model": rollout.model,
        "canary": rollout.canary,
        "stable": rollout.stable,
        "state": rollout.state,
        "step_index": rollout.step_index,
        "weight": step_weight(rollout, rollout.step_index),
        "policy": rollout.policy,
        "started_at": rollout.started_at.isoformat(),
        "step_started_at": rollout.step_started_at.isoformat(),
        "finished_at": rollout.finished_at.isoformat() if rollout.finished_at else None,
        "reason": rollout.reason,
        "decisions": [
            {"id": d.id, "at": d.at.isoformat(), "step_index": d.step_index, "action": d.action,
             "reason": d.reason, "audit_id": d.audit_id, "evidence": d.evidence} for d in history
        ],
    }
