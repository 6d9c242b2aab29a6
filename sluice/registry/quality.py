"""Quality aggregates: one row per version per time window, written by the scheduler."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from sluice.registry.tables import QualityAggregate


def record_window(session: Session, *, model: str, version: str, window_start: float, window_s: int,
                  count: int, errors: int, metrics: dict[str, Any]) -> bool:
    """Store one window's aggregate; answer False when that window was already stored (a second
    scheduler, or a restart, must not double it)."""
    statement = insert(QualityAggregate).values(
        model=model, version=version, window_start=datetime.fromtimestamp(window_start, tz=UTC),
        window_s=window_s, count=count, errors=errors, metrics=metrics,
    ).on_conflict_do_nothing(constraint="quality_window").returning(QualityAggregate.id)
    return session.execute(statement).scalar_one_or_none() is not None


def windows(session: Session, *, model: str, version: str, since: float) -> list[dict[str, Any]]:
    rows = session.scalars(
        select(QualityAggregate)
        .where(QualityAggregate.model == model, QualityAggregate.version == version,
               QualityAggregate.window_start >= datetime.fromtimestamp(since, tz=UTC))
        .order_by(QualityAggregate.window_start)
    )
    return [{"window_start": row.window_start.isoformat(), "window_s": row.window_s, "count": row.count,
             "errors": row.errors, "metrics": row.metrics} for row in rows]
