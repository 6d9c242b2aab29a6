"""The audit log: every change to routing, pins, versions, tiers, tenants, keys and schedules, and an
admin's cancel of a batch, writes one row in the transaction that makes the change, so the log can
never disagree with the table it describes."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from sluice.errors import NotFound
from sluice.registry.tables import (
    AuditEntry,
    Model,
)


def record(
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
