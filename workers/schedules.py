"""The schedule dispatcher: every due slot of every cron schedule becomes one batch.

Beat sends the dispatch every `batch_sweep_s`; running it twice at once (two beat processes) or
again after a restart in the middle of a slot creates nothing twice: the slot's batch is made
under the schedule's row lock and the unique (schedule, slot) constraint
(`sluice.registry.batches.take_due_slots`).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from zoneinfo import ZoneInfo

from sluice.batch_files import format_of, render_template
from sluice.errors import SluiceError
from sluice.registry import batches as queries
from sluice.registry.routing_table import routing_snapshot
from sluice.registry.store import Registry
from sluice.routing import route
from sluice.tenant_files import resolve
from sluice.vocabulary import BatchState

log = logging.getLogger(__name__)


def dispatch_due(registry: Registry, *, batch_root: Path | None, now: datetime) -> list[str]:
    """Create the batch of every due slot; answer the new batches' ids. A slot whose input is
    missing, or whose model has no servable version, gets a failed batch that says why: a run
    that could not happen is listed, not skipped in silence."""
    created = []
    with registry.session() as session:
        snapshot = routing_snapshot(session)
        for due in queries.take_due_slots(session, now=now):
            schedule = due.schedule
            local = due.slot.astimezone(ZoneInfo(schedule.timezone))
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
