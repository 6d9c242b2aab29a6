"""A version's tuning record: its p99 budget, whether the nightly job may apply a proposal itself,
when and on what mix its batching was last tuned (`tuned_at`, `tuned_on`), and the job's last
proposal (scheduler/retune.py). Applying a proposal is a batching change like any other: it goes
through `catalog.update_version` and its audit row.

`tuned_on` is `{"mix": {bucket: count}, "samples": n, "since": iso day}`: the recorded mix the
proposal was planned on, so the drift gauge compares today's mix with exactly that one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from sluice.errors import Conflict
from sluice.mix import Mix
from sluice.registry import catalog
from sluice.registry.tables import AuditEntry, ModelVersion
from sluice.versions import VersionState


@dataclass(frozen=True, slots=True)
class Tuning:
    model: str
    version: str
    max_batch_size: int
    max_wait_ms: float
    p99_budget_ms: float | None
    auto_tune: bool
    tuned_at: datetime | None
    tuned_on: dict[str, Any] | None
    proposal: dict[str, Any] | None

    @property
    def tuned_mix(self) -> Mix | None:
        return Mix.from_mapping(self.tuned_on["mix"]) if self.tuned_on else None


def _of(row: ModelVersion) -> Tuning:
    return Tuning(model=row.model, version=row.version, max_batch_size=row.max_batch_size,
                  max_wait_ms=row.max_wait_ms, p99_budget_ms=row.p99_budget_ms, auto_tune=row.auto_tune,
                  tuned_at=row.tuned_at, tuned_on=row.tuned_on, proposal=row.tune_proposal)


def served(session: Session) -> list[Tuning]:
    """Every version that is not retired, by model and version."""
    rows = session.scalars(select(ModelVersion).where(ModelVersion.state != VersionState.retired)
                           .order_by(ModelVersion.model, ModelVersion.version))
    return [_of(row) for row in rows]


def record_proposal(session: Session, *, model: str, version: str, proposal: Mapping[str, Any] | None) -> None:
    """Keep the job's last proposal (None: it had nothing to propose); not audited, it changes
    nothing served."""
    row = catalog.get_version(session, model, version)
    row.tune_proposal = dict(proposal) if proposal is not None else None


def apply_proposal(session: Session, *, model: str, version: str, actor: str, reason: str | None,
                   now: datetime, batch_timeout_s: float,
                   changes: Mapping[str, Any] | None = None) -> tuple[ModelVersion, AuditEntry]:
    """Set the batching to the version's proposal and date it: `tuned_at` now, `tuned_on` the mix it
    was planned on, with any other `changes` of the same PATCH (`catalog.update_version`'s
    arguments). One audit row, as for any batching change, because it is one."""
    row = catalog.get_version(session, model, version)
    proposal = row.tune_proposal
    if not proposal:
        raise Conflict(f"version '{model}/{version}' has no tuning proposal to apply")
    return catalog.update_version(session, model=model, version=version, actor=actor, reason=reason,
                                  max_batch_size=int(proposal["max_batch_size"]),
                                  max_wait_ms=float(proposal["max_wait_ms"]), batch_timeout_s=batch_timeout_s,
                                  tuned=(now, proposal["on"]), **(changes or {}))
