"""Queries of batch scoring: the batch resource, its feeder's lease and checkpoint, and the cron
schedules that create batches, each due slot exactly once.

Exactly once rests on the database, not on beat: a slot's batch is inserted under the unique
(schedule_id, slot) constraint while the schedule's row is locked, so two beat processes, or a
dispatcher restarted in the middle of a slot, can at worst find the slot already taken.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import func, or_, select, update
from sqlalchemy.orm import Session

from sluice.errors import Conflict, NotFound
from sluice.registry import audit
from sluice.registry.tables import Batch, Model, Schedule, Tenant
from sluice.schedule_slots import due_slots, next_slot
from sluice.vocabulary import FINAL_BATCH_STATES, BatchState


def new_batch_id() -> str:
    return "bat_" + secrets.token_urlsafe(16)


def new_schedule_id() -> str:
    return "sch_" + secrets.token_urlsafe(12)


def _iso(value: datetime | None) -> str | None:
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z") if value is not None else None


def batch_resource(row: Batch) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": row.id, "model": row.model, "version": row.version, "status": row.status,
        "total": row.total, "done": row.done, "failed": row.failed,
        "created_at": _iso(row.created_at), "started_at": _iso(row.started_at), "finished_at": _iso(row.finished_at),
        "output": {"url": f"/v1/batches/{row.id}/output", "format": row.output_format},
    }
    if row.error:
        body["error"] = row.error
    if row.schedule_id is not None:
        body["schedule_id"] = row.schedule_id
        body["slot"] = _iso(row.slot)
    if row.metadata_:
        body["metadata"] = row.metadata_
    return body


@dataclass(frozen=True, slots=True)
class NewBatch:
    """What a batch is made of; `input_path` is the file the feeder reads (already on disk)."""

    tenant: str
    model: str
    version: str
    input_path: str
    input_format: str
    text_field: str
    output_format: str = "jsonl"
    output_path: str | None = None
    callback_url: str | None = None
    metadata: dict[str, Any] | None = None
    # Known at submit for inline inputs; otherwise the feeder counts the file's rows.
    total: int | None = None


def create_batch(session: Session, spec: NewBatch, *, batch_id: str | None = None) -> Batch:
    row = Batch(id=batch_id or new_batch_id(), tenant_id=spec.tenant, model=spec.model, version=spec.version,
                status=BatchState.queued, input_path=spec.input_path, input_format=spec.input_format,
                text_field=spec.text_field, output_format=spec.output_format, output_path=spec.output_path,
                callback_url=spec.callback_url, metadata_=spec.metadata or None, total=spec.total)
    session.add(row)
    session.flush()
    session.refresh(row)
    return row


def get_batch(session: Session, batch_id: str, *, tenant: str | None = None) -> Batch:
    """The batch; another tenant's answers like a missing one."""
    row = session.get(Batch, batch_id)
    if row is None or (tenant is not None and row.tenant_id != tenant):
        raise NotFound(f"batch '{batch_id}' does not exist")
    return row


def list_batches(session: Session, *, tenant: str | None, schedule_id: str | None = None,
                 limit: int = 50) -> Sequence[Batch]:
    query = select(Batch).order_by(Batch.created_at.desc(), Batch.id).limit(limit)
    if tenant is not None:
        query = query.where(Batch.tenant_id == tenant)
    if schedule_id is not None:
        query = query.where(Batch.schedule_id == schedule_id)
    return session.scalars(query).all()


def cancel_batch(session: Session, batch_id: str, *, tenant: str | None, now: datetime,
                 audit_actor: str | None = None) -> Batch:
    """Cancel what has not started: a queued batch ends now; a running one is `cancelled` at once and
    its feeder stops submitting, cancels its queued jobs and sets `finished_at` once the output
    holds every row that ran. `tenant` None: any tenant's (an admin's key). With `audit_actor` the
    cancel is an audited change (an admin's); a tenant's own is not, like a job's."""
    row = session.get(Batch, batch_id, with_for_update=True)
    if row is None or (tenant is not None and row.tenant_id != tenant):
        raise NotFound(f"batch '{batch_id}' does not exist")
    if row.status in FINAL_BATCH_STATES:
        raise Conflict(f"batch '{batch_id}' is {row.status}; only a queued or running batch can be cancelled")
    before = row.status
    if row.status == BatchState.queued:
        row.finished_at = now
    row.status = BatchState.cancelled
    session.flush()
    if audit_actor is not None:
        audit.record(session, actor=audit_actor, action="batch.cancel", model=row.model,
                     before={"batch": row.id, "tenant": row.tenant_id, "status": before},
                     after={"batch": row.id, "tenant": row.tenant_id, "status": row.status}, reason=None)
    return row


# --- the feeder's lease ------------------------------------------------------------------------------


def claim(session: Session, batch_id: str, *, owner: str, now: datetime, lease_s: float,
          max_running: int) -> Batch | None:
    """Take the batch for `owner` unless another feeder holds a live lease, it is finished, or
    (for a batch not started yet) `max_running` batches are being fed already."""
    row = session.get(Batch, batch_id, with_for_update=True)
    if row is None or row.finished_at is not None:
        return None
    if row.lease_until is not None and row.lease_until > now and row.lease_owner != owner:
        return None
    if row.status == BatchState.queued:
        running = session.scalar(select(func.count()).select_from(Batch).where(
            Batch.status == BatchState.running, Batch.lease_until > now, Batch.id != batch_id))
        if (running or 0) >= max_running:
            return None
        row.status = BatchState.running
        row.started_at = now
    row.lease_owner = owner
    row.lease_until = now + timedelta(seconds=lease_s)
    session.flush()
    return row


@dataclass(frozen=True, slots=True)
class Progress:
    done: int
    failed: int
    rows_written: int
    bytes_written: int


def checkpoint(session: Session, batch_id: str, *, owner: str, progress: Progress, now: datetime,
               lease_s: float, total: int | None = None) -> str | None:
    """Record progress and renew the lease; answer the batch's status, or None when the lease was
    lost (another feeder took over: this one must stop writing at once)."""
    values: dict[str, Any] = {
        "done": progress.done, "failed": progress.failed, "rows_written": progress.rows_written,
        "bytes_written": progress.bytes_written, "lease_until": now + timedelta(seconds=lease_s),
    }
    if total is not None:
        values["total"] = total
    status = session.scalar(update(Batch).where(Batch.id == batch_id, Batch.lease_owner == owner,
                                                Batch.finished_at.is_(None))
                            .values(**values).returning(Batch.status))
    return status


def finish(session: Session, batch_id: str, *, owner: str, status: str, now: datetime,
           error: str | None = None) -> bool:
    """End the batch (a cancelled one stays cancelled); False when the lease was lost."""
    row = session.get(Batch, batch_id, with_for_update=True)
    if row is None or row.lease_owner != owner or row.finished_at is not None:
        return False
    if row.status != BatchState.cancelled:
        row.status = status
    row.error = error
    row.finished_at = now
    row.lease_owner = None
    row.lease_until = None
    return True


def release(session: Session, batch_id: str, *, owner: str, now: datetime) -> None:
    session.execute(update(Batch).where(Batch.id == batch_id, Batch.lease_owner == owner)
                    .values(lease_until=now, dispatched_at=None))


def fail_unstarted(session: Session, batch_id: str, *, now: datetime, error: str) -> None:
    row = session.get(Batch, batch_id, with_for_update=True)
    if row is not None and row.finished_at is None:
        row.status, row.error, row.finished_at = BatchState.failed, error, now


def to_dispatch(session: Session, *, now: datetime, lease_s: float, limit: int = 100) -> list[str]:
    """Batches that need a feeder: unfinished, with no live lease, not sent to Celery within a
    lease period. Marked as sent in the same transaction, so two sweeps send each once."""
    stale = now - timedelta(seconds=lease_s)
    rows = session.scalars(
        select(Batch).where(
            Batch.finished_at.is_(None),
            or_(Batch.lease_until.is_(None), Batch.lease_until < now),
            or_(Batch.dispatched_at.is_(None), Batch.dispatched_at < stale),
        ).order_by(Batch.created_at).limit(limit).with_for_update(skip_locked=True)
    ).all()
    for row in rows:
        row.dispatched_at = now
    return [row.id for row in rows]


def undelivered_callbacks(session: Session, *, limit: int = 100) -> list[str]:
    """Finished batches with a callback not yet handed to the webhook outbox."""
    return list(session.scalars(
        select(Batch.id).where(Batch.finished_at.is_not(None), Batch.callback_url.is_not(None),
                               Batch.callback_sent.is_(False)).limit(limit)
    ).all())


def mark_callback_sent(session: Session, batch_ids: Sequence[str]) -> None:
    if batch_ids:
        session.execute(update(Batch).where(Batch.id.in_(batch_ids)).values(callback_sent=True))


# --- schedules ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NewSchedule:
    tenant: str
    model: str
    version: str | None
    cron: str
    timezone: str
    input_uri: str
    input_format: str | None
    text_field: str
    output_uri: str | None
    output_format: str
    callback_url: str | None


def _schedule_fields(row: Schedule) -> dict[str, Any]:
    return {"schedule": row.id, "tenant": row.tenant_id, "model": row.model, "version": row.version,
            "cron": row.cron, "timezone": row.timezone, "input_uri": row.input_uri, "output_uri": row.output_uri}


def create_schedule(session: Session, spec: NewSchedule, *, actor: str, now: datetime) -> Schedule:
    if session.get(Model, spec.model) is None:
        raise NotFound(f"model '{spec.model}' does not exist")
    if session.get(Tenant, spec.tenant) is None:
        raise NotFound(f"tenant '{spec.tenant}' does not exist")
    row = Schedule(id=new_schedule_id(), tenant_id=spec.tenant, model=spec.model, version=spec.version,
                   cron=spec.cron, timezone=spec.timezone, input_uri=spec.input_uri, input_format=spec.input_format,
                   text_field=spec.text_field, output_uri=spec.output_uri, output_format=spec.output_format,
                   callback_url=spec.callback_url, actor=actor,
                   next_slot=next_slot(spec.cron, spec.timezone, now))
    session.add(row)
    session.flush()
    session.refresh(row)
    audit.record(session, actor=actor, action="schedule.create", model=row.model, before=None,
                 after=_schedule_fields(row), reason=None)
    return row


def schedule_resource(row: Schedule) -> dict[str, Any]:
    return {
        "id": row.id, "tenant": row.tenant_id, "model": row.model, "version": row.version, "cron": row.cron,
        "timezone": row.timezone, "input_uri": row.input_uri, "input_format": row.input_format,
        "text_field": row.text_field, "output_uri": row.output_uri, "output_format": row.output_format,
        "callback_url": row.callback_url, "created_at": _iso(row.created_at), "next_run_at": _iso(row.next_slot),
        "last_error": row.last_error, "last_error_at": _iso(row.last_error_at),
    }


def list_schedules(session: Session) -> Sequence[Schedule]:
    return session.scalars(select(Schedule).order_by(Schedule.created_at, Schedule.id)).all()


def get_schedule(session: Session, schedule_id: str) -> Schedule:
    row = session.get(Schedule, schedule_id)
    if row is None:
        raise NotFound(f"schedule '{schedule_id}' does not exist")
    return row


def delete_schedule(session: Session, schedule_id: str, *, actor: str) -> Schedule:
    row = get_schedule(session, schedule_id)
    audit.record(session, actor=actor, action="schedule.delete", model=row.model, before=_schedule_fields(row),
                 after=None, reason=None)
    session.delete(row)
    session.flush()
    return row


@dataclass(frozen=True, slots=True)
class DueSlot:
    schedule: Schedule
    slot: datetime


def due_schedules(session: Session, *, now: datetime) -> list[str]:
    """The schedules with a due slot, the most overdue first; each is taken in its own transaction."""
    return list(session.scalars(select(Schedule.id).where(Schedule.next_slot <= now)
                                .order_by(Schedule.next_slot, Schedule.id)).all())


def take_due_slots(session: Session, schedule_id: str, *, now: datetime) -> list[DueSlot]:
    """Lock the schedule unless another dispatcher holds it, and advance it past its due slots (none
    when it is held or no longer due); the caller creates one batch per slot with `create_run` in
    the same transaction, so a slot is taken and run together or not at all. A dispatch that gets
    this far clears the schedule's last error."""
    schedule = session.scalars(select(Schedule).where(Schedule.id == schedule_id, Schedule.next_slot <= now)
                               .with_for_update(skip_locked=True)).first()
    if schedule is None:
        return []
    due = due_slots(schedule.cron, schedule.timezone, first=schedule.next_slot, now=now)
    schedule.next_slot = due.following
    schedule.last_error = schedule.last_error_at = None
    return [DueSlot(schedule, slot) for slot in due.slots]


def record_dispatch_error(session: Session, schedule_id: str, *, error: str, now: datetime) -> bool:
    """Why the schedule could not be dispatched (its slots stay due, for the next sweep); True
    when the error is not the one already recorded."""
    row = session.get(Schedule, schedule_id, with_for_update=True)
    if row is None:
        return False
    new = row.last_error != error
    row.last_error, row.last_error_at = error, now
    return new


def create_run(session: Session, due: DueSlot, spec: NewBatch, *, status: str = BatchState.queued,
               error: str | None = None, now: datetime) -> Batch | None:
    """The slot's batch, or None when the slot already has one."""
    with session.begin_nested():
        if session.scalar(select(Batch.id).where(Batch.schedule_id == due.schedule.id, Batch.slot == due.slot)):
            return None
        row = create_batch(session, spec)
        row.schedule_id, row.slot = due.schedule.id, due.slot
        if status != BatchState.queued:
            row.status, row.error, row.finished_at = status, error, now
        session.flush()
    return row
