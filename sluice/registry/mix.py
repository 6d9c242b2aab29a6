"""The served mix's daily aggregates: one row per version, lane and UTC day, written by the
scheduler's mix aggregator (scheduler/mix.py) from the counts workers flush to Redis.

A day's row is replaced, not added to: Redis holds the day's running total (every worker adds to
it), so folding the same hours again, from a second scheduler or after a restart, writes the same
row.
"""

from __future__ import annotations

from datetime import date

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from sluice.mix import Mix
from sluice.registry.tables import MixAggregate


def record_day(session: Session, *, model: str, version: str, lane: str, day: date, mix: Mix) -> None:
    counts = mix.to_mapping()
    statement = insert(MixAggregate).values(
        model=model, version=version, lane=lane, day=day, total=mix.total, counts=counts,
    ).on_conflict_do_update(constraint="mix_day", set_={"total": mix.total, "counts": counts})
    session.execute(statement)


def days(session: Session, *, model: str, version: str, since: date) -> list[tuple[date, str, Mix]]:
    """The version's days from `since` on, oldest first: (day, lane, mix)."""
    rows = session.scalars(
        select(MixAggregate)
        .where(MixAggregate.model == model, MixAggregate.version == version, MixAggregate.day >= since)
        .order_by(MixAggregate.day, MixAggregate.lane)
    )
    return [(row.day, row.lane, Mix.from_mapping(row.counts)) for row in rows]
