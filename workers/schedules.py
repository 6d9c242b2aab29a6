"""The schedule dispatcher: every due slot of every cron schedule becomes one batch.

Beat sends the dispatch every `batch_sweep_s`; running it twice at once (two beat processes) or
again after a restart in the middle of a slot creates nothing twice: the slot's batch is made
under the schedule's row lock and the unique (schedule, slot) constraint
(`sluice.registry.batches.take_due_slots`).

Each schedule is dispatched in a transaction of its own, so one that fails for a reason nobody
foresaw (a zone this host's tzdata no longer has, a query Postgres refuses) records why in its
`last_error`, stays due for the next sweep, and stops no other schedule. Only Postgres being
unreachable ends the sweep.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from datetime import datetime
from pathlib import Path

from sluice.batch_files import format_of, render_template
from sluice.errors import RegistryUnavailable, SluiceError
from sluice.registry import batches as queries
from sluice.registry.routing_table import routing_snapshot
from sluice.registry.store import Registry
from sluice.routing import RoutingSnapshot, route
from sluice.schedule_slots import zone_of
from sluice.tenant_files import resolve
from sluice.vocabulary import BatchState

log = logging.getLogger(__name__)

# The longest `last_error` kept: the exception's text, which may quote a long URI.
MAX_ERROR_CHARS = 2000


def dispatch_due(registry: Registry, *, batch_root: Path | None, now: datetime) -> list[str]:
    """Create the batch of every due slot; answer the new batches' ids. A slot whose input is
    missing, or whose model has no servable version, gets a failed batch that says why: a run
    that could not happen is listed, not skipped in silence."""
    with registry.session() as session:
        snapshot = routing_snapshot(session)
        due = queries.due_schedules(session, now=now)
    created = []
    for schedule_id in due:
        try:
            created += _dispatch(registry, snapshot, schedule_id, batch_root=batch_root, now=now)
        except RegistryUnavailable:
            raise
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
            with registry.session() as session:
                new = queries.record_dispatch_error(session, schedule_id, error=error, now=now)
            # Retried every sweep: the traceback once per new error, not every few seconds.
            log.log(logging.ERROR if new else logging.DEBUG, "schedule %s not dispatched (retried at the "
                    "next sweep): %s", schedule_id, error, exc_info=exc if new else None)
    return created


def _dispatch(registry: Registry, snapshot: RoutingSnapshot, schedule_id: str, *, batch_root: Path | None,
              now: datetime) -> list[str]:
    created = []
    with registry.session() as session:
        for due in queries.take_due_slots(session, schedule_id, now=now):
            schedule = due.schedule
            local = due.slot.astimezone(zone_of(schedule.timezone))
            # What a failed run records when the slot's input or version cannot be resolved.
            spec = queries.NewBatch(
                tenant=schedule.tenant_id, model=schedule.model, version=schedule.version or "",
                input_path=schedule.input_uri, input_format=schedule.input_format or "jsonl",
                text_field=schedule.text_field, output_format=schedule.output_format,
                callback_url=schedule.callback_url,
            )
            status, error = BatchState.queued, None
            try:
                path = resolve(render_template(schedule.input_uri, local), root=batch_root,
                               tenant=schedule.tenant_id, admin=False, must_exist=True)
                output = (resolve(render_template(schedule.output_uri, local), root=batch_root,
                                  tenant=schedule.tenant_id, admin=False, must_exist=False)
                          if schedule.output_uri else None)
                decision = route(snapshot, model=schedule.model, tenant=schedule.tenant_id, routing_key=None,
                                 version=schedule.version, blocked=(), admin=True)
                spec = replace(spec, version=decision.version.version, input_path=str(path),
                               input_format=format_of(path.name, schedule.input_format),
                               output_path=str(output) if output else None)
            except SluiceError as exc:
                status, error = BatchState.failed, str(exc)
            row = queries.create_run(session, due, spec, status=status, error=error, now=now)
            if row is not None:
                created.append(row.id)
                log.info("schedule %s: slot %s -> batch %s (%s)", schedule.id, due.slot.isoformat(), row.id, status)
    return created

