"""The batch feeder: reads a batch's input as a stream, keeps a bounded number of its rows queued
on the version's bulk lane, and writes their results in input order.

The bulk lane is read only when the online lane has nothing ready, so a batch takes the capacity
online traffic leaves; `max_in_flight` bounds what it holds in Redis at any moment.

An input the reader cannot go on with (`sluice.batch_rows`: a line over the bound, a Parquet row
group that does not decode) ends the batch `failed` with the row and why, as a cancel ends it: what
was queued is cancelled, what ran is written. It never escapes the task, which would leave the
batch to be sent again every lease period.

Exactly once, across a feeder killed at any point:
- row r's job id is derived from the batch id and r, so a feeder that takes over finds the jobs
  its predecessor queued instead of queueing them again;
- output lines are appended in row order, and every checkpoint records (rows, bytes) written
  after an fsync; a new feeder truncates the output to the recorded bytes and goes on from the
  recorded row, so a line written after the last checkpoint is written once more, never twice;
- the lease in the registry is renewed with each checkpoint; a feeder whose renewal finds
  another owner stops before writing anything more. A job's record is deleted only after its
  line is checkpointed.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import islice
from pathlib import Path
from typing import Any

import redis as redis_sync

from sluice.batch_files import BatchFileError, Format, error_json, output_line, write_output
from sluice.batch_rows import Row, count_rows, read_rows
from sluice.errors import InvalidInput, SluiceError
from sluice.kinds import ModelKind, schema_text, validate_input
from sluice.registry import batches as queries
from sluice.registry.store import Registry
from sluice.registry.tables import Model, ModelVersion
from sluice.tenant_files import recheck
from sluice.versions import VersionState
from sluice.vocabulary import BatchState
from sluice.wire import keys, scripts
from sluice.wire.connections import translate_redis_errors
from sluice.wire.jobs import FINAL_STATES, JobRecord, JobStatus
from sluice.wire.outbox import OutboxEntry
from sluice.wire.streams import queue_jobs

log = logging.getLogger(__name__)

# Rows read and queued per round trip, and job statuses read per poll.
CHUNK_ROWS = 128


def job_id(batch_id: str, row: int, *, model: str, version: str) -> str:
    """A row's job id: the same for every feeder of the batch, in its version's slot (`sluice.wire.keys`)."""
    return f"job_{keys.version_code(model, version)}.{batch_id.removeprefix('bat_')}_{row}"


def callback_delivery_id(batch_id: str) -> str:
    return f"dlv_{batch_id}"


@dataclass(slots=True)
class _Slot:
    row: int
    record: JobRecord | None = None
    error: bytes | None = None


@dataclass(slots=True)
class _Run:
    """One feeder's pass over one batch."""

    id: str
    tenant: str
    model: str
    version: str
    kind: ModelKind
    input_schema: str | None
    input_path: Path
    input_format: Format
    text_field: str
    output_format: Format
    output_path: str | None
    total: int | None
    done: int
    failed: int
    rows_written: int
    bytes_written: int
    status: str
    window: deque[_Slot] = field(default_factory=deque)
    # Why the input cannot be read on: no more rows are queued, and the batch ends failed.
    error: str | None = None
    cancel_sent: bool = False
    checkpointed_ids: list[str] = field(default_factory=list)


class LeaseLost(Exception):
    """Another feeder took the batch over: this one stops without writing more."""


class VersionRetired(SluiceError):
    """The batch's version was retired: the batch ends `failed` with the code `version_retired`."""


class BatchFeeder:
    def __init__(
        self,
        *,
        redis: redis_sync.Redis,
        registry: Registry,
        storage: Path,
        batch_root: Path | None,
        max_in_flight: int,
        max_running: int,
        lease_s: float,
        checkpoint_s: float,
        max_line_bytes: int,
        result_ttl_s: int,
        max_text_chars: int,
        poll_s: float = 0.05,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.redis = redis
        self.registry = registry
        self.storage = storage
        self.batch_root = batch_root
        self.max_in_flight = max_in_flight
        self.max_running = max_running
        self.lease_s = lease_s
        self.checkpoint_s = checkpoint_s
        self.max_line_bytes = max_line_bytes
        self.result_ttl_s = result_ttl_s
        self.max_text_chars = max_text_chars
        self.poll_s = poll_s
        self.clock = clock
        self._cancel = redis.register_script(scripts.CANCEL)
        self._stop = threading.Event()

    def close(self) -> None:
        self.registry.dispose()
        self.redis.close()

    def request_stop(self) -> None:
        """Stop feeding at the next checkpoint; the lease lapses and another feeder goes on."""
        self._stop.set()

    def _now(self) -> datetime:
        return datetime.fromtimestamp(self.clock(), UTC)

    def output_file(self, batch_id: str) -> Path:
        return self.storage / batch_id / "output.jsonl"

    # --- one batch ------------------------------------------------------------------------------

    def run(self, batch_id: str) -> str:
        """Feed the batch to its end; answer what happened (for the task's result and logs)."""
        owner = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        run = self._claim(batch_id, owner)
        if run is None:
            return "skipped"
        log.info("feeding batch %s from row %d", batch_id, run.rows_written)
        try:
            outcome = self._feed(run, owner)
        except LeaseLost:
            log.warning("batch %s: another feeder took over", batch_id)
            return "lease_lost"
        except BatchFileError as exc:
            self._finish(run, owner, BatchState.failed, error=exc.message)
            return BatchState.failed
        except VersionRetired as exc:
            log.warning("batch %s: %s", batch_id, exc)
            self._cancel_queued(run)
            self._finish(run, owner, BatchState.failed, error=str(exc))
            return BatchState.failed
        return outcome

    def _claim(self, batch_id: str, owner: str) -> _Run | None:
        with self.registry.session() as session:
            row = queries.claim(session, batch_id, owner=owner, now=self._now(), lease_s=self.lease_s,
                                max_running=self.max_running)
            if row is None:
                return None
            model = session.get(Model, row.model)
            if model is None:
                queries.fail_unstarted(session, batch_id, now=self._now(),
                                       error=f"model '{row.model}' no longer exists")
                return None
            version = session.get(ModelVersion, (row.model, row.version))
            declared = version.input_schema if version is not None else None
            run = _Run(id=row.id, tenant=row.tenant_id, model=row.model, version=row.version,
                       kind=ModelKind(model.kind), input_schema=None if declared is None else schema_text(declared),
                       input_path=Path(row.input_path),
                       input_format=row.input_format,  # type: ignore[arg-type]
                       text_field=row.text_field, output_format=row.output_format,  # type: ignore[arg-type]
                       output_path=row.output_path, total=row.total, done=row.done, failed=row.failed,
                       rows_written=row.rows_written, bytes_written=row.bytes_written, status=row.status)
        return run

    def _feed(self, run: _Run, owner: str) -> str:
        if not run.input_path.is_relative_to(self.storage):
            # Named by input_uri: checked again now, since the folder may have changed since submit.
            run.input_path = recheck(run.input_path, root=self.batch_root, tenant=run.tenant)
        if not run.input_path.is_file():
            raise BatchFileError(f"the batch's input {run.input_path.name} is gone")
        out_path = self.output_file(run.id)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        exhausted = False
        with out_path.open("ab") as out:
            out.truncate(run.bytes_written)
            out.seek(run.bytes_written)
            self._checkpoint(run, owner, out)
            if run.total is None and run.status != BatchState.cancelled and not self._count(run, owner, out):
                return "stopped"
            last_checkpoint = self.clock()
            rows = read_rows(run.input_path, run.input_format, text_field=run.text_field,
                             max_line_bytes=self.max_line_bytes, start=run.rows_written)
            while True:
                # A batch cancelled, or whose input cannot be read on, queues nothing more; its
                # queued jobs end cancelled, its running ones finish and are written.
                stopping = run.status == BatchState.cancelled or run.error is not None
                if not stopping and not exhausted and len(run.window) < self.max_in_flight:
                    exhausted = self._fill(run, rows)
                progressed = self._drain(run, out)
                if stopping and not run.cancel_sent:
                    self._cancel_queued(run)
                if not run.window and (exhausted or stopping):
                    self._checkpoint(run, owner, out)
                    break
                if self.clock() - last_checkpoint >= self.checkpoint_s:
                    self._checkpoint(run, owner, out)
                    last_checkpoint = self.clock()
                    if self._stop.is_set():
                        self._release(run, owner)
                        return "stopped"
                if not progressed:
                    time.sleep(self.poll_s)
        if run.error is not None:
            self._finish(run, owner, BatchState.failed, error=run.error)
            return BatchState.failed
        if run.output_path and run.status != BatchState.cancelled:
            destination = recheck(Path(run.output_path), root=self.batch_root, tenant=run.tenant)
            write_output(out_path, run.output_format, destination, size=run.bytes_written)
        status = BatchState.cancelled if run.status == BatchState.cancelled else BatchState.succeeded
        self._finish(run, owner, status)
        return status

    def _count(self, run: _Run, owner: str, out: Any) -> bool:
        """Count the input's rows into `run.total`, checkpointing as it goes: the lease stays held
        and a cancel stops the count (the total stays unknown). False when the worker is stopping
        (the batch is handed back)."""
        last_checkpoint = self.clock()
        total = None
        for counted in count_rows(run.input_path, run.input_format, max_line_bytes=self.max_line_bytes):
            total = counted
            if self.clock() - last_checkpoint >= self.checkpoint_s:
                self._checkpoint(run, owner, out)
                last_checkpoint = self.clock()
                if self._stop.is_set():
                    self._release(run, owner)
                    return False
                if run.status == BatchState.cancelled:
                    return True
        run.total = total
        # At once, so the batch shows its total before its first rows are done.
        self._checkpoint(run, owner, out)
        return True

    def _fill(self, run: _Run, rows: Iterator[Row]) -> bool:
        """Read and queue up to a chunk of rows; answer whether the input is exhausted (or cannot
        be read on: `run.error` says why, and the rows read before are queued all the same)."""
        room = min(CHUNK_ROWS, self.max_in_flight - len(run.window))
        taken: list[_Slot] = []
        exhausted = False
        for _ in range(room):
            try:
                row = next(rows, None)
            except BatchFileError as exc:
                run.error = exc.message
                row = None
            if row is None:
                exhausted = True
                break
            taken.append(self._slot(run, row))
        records = [slot.record for slot in taken if slot.record is not None]
        if records:
            with translate_redis_errors():
                pipe = self.redis.pipeline(transaction=False)
                for record in records:
                    pipe.exists(keys.job(record.id))
                present = pipe.execute()
            # Jobs a feeder before this one queued are waited for, not queued again.
            self._queue([record for record, there in zip(records, present, strict=True) if not there])
        run.window.extend(taken)
        return exhausted

    def _slot(self, run: _Run, row: Row) -> _Slot:
        if row.error is not None:
            return _Slot(row.row, error=error_json("invalid_input", row.error))
        try:
            canonical, cost = validate_input(run.kind, row.input, max_text_chars=self.max_text_chars,
                                            schema=run.input_schema)
        except InvalidInput as exc:
            return _Slot(row.row, error=error_json(exc.code, exc.message))
        return _Slot(row.row, record=JobRecord(
            id=job_id(run.id, row.row, model=run.model, version=run.version), tenant=run.tenant, model=run.model,
            version=run.version, lane="bulk",
            status=JobStatus.queued, input=canonical, cost=cost, enqueued_at=self.clock(),
            metadata={"batch": run.id, "row": row.row}, request_id=run.id))

    def _queue(self, records: list[JobRecord]) -> None:
        if not records:
            return
        # One transaction (the records and the stream share the version's slot): a record without
        # its stream entry would wait forever.
        with translate_redis_errors():
            pipe = self.redis.pipeline(transaction=True)
            queue_jobs(pipe, records, result_ttl_s=self.result_ttl_s)
            pipe.execute()

    def _drain(self, run: _Run, out: Any) -> bool:
        """Write the lines of the window's leading rows that are final; answer whether any was."""
        head = list(islice(run.window, CHUNK_ROWS))
        with translate_redis_errors():
            pipe = self.redis.pipeline(transaction=False)
            for slot in head:
                if slot.record is not None:
                    pipe.hget(keys.job(slot.record.id), "status")
            statuses = iter(pipe.execute())
        ready: list[_Slot] = []
        lost: list[JobRecord] = []
        for slot in head:
            if slot.record is None:
                ready.append(slot)
                continue
            status = next(statuses)
            if status is None:
                # Its record is gone (flushed or expired): queued again, written when it is final.
                lost.append(slot.record)
                break
            if JobStatus(status.decode()) not in FINAL_STATES:
                break
            ready.append(slot)
        self._queue(lost)
        if not ready:
            return False
        with translate_redis_errors():
            pipe = self.redis.pipeline(transaction=False)
            for slot in ready:
                if slot.record is not None:
                    pipe.hmget(keys.job(slot.record.id), ["status", "output", "error"])
            fields = iter(pipe.execute())
        for slot in ready:
            run.window.popleft()
            if slot.record is None:
                line = output_line(slot.row, JobStatus.failed, error=slot.error)
                run.failed += 1
            else:
                status, output, error = next(fields)
                state = status.decode() if status else JobStatus.failed
                line = output_line(slot.row, state, output=output if state == JobStatus.succeeded else None,
                                   error=error if state != JobStatus.succeeded else None)
                run.checkpointed_ids.append(slot.record.id)
                if state == JobStatus.succeeded:
                    run.done += 1
                elif state != JobStatus.cancelled:
                    run.failed += 1
            out.write(line)
            run.rows_written += 1
            run.bytes_written += len(line)
        return True

    def _cancel_queued(self, run: _Run) -> None:
        """The batch was cancelled: its queued jobs end as cancelled rows, its running ones finish."""
        run.cancel_sent = True
        now = repr(self.clock())
        with translate_redis_errors():
            for slot in run.window:
                if slot.record is not None:
                    # A batch's jobs take no quota places (`queue_jobs`): there is none to free.
                    self._cancel(keys=[keys.job(slot.record.id), keys.outbox(run.model, run.version)], args=[now])

    def _checkpoint(self, run: _Run, owner: str, out: Any) -> None:
        out.flush()
        os.fsync(out.fileno())
        progress = queries.Progress(done=run.done, failed=run.failed, rows_written=run.rows_written,
                                    bytes_written=run.bytes_written)
        with self.registry.session() as session:
            status = queries.checkpoint(session, run.id, owner=owner, progress=progress, now=self._now(),
                                        lease_s=self.lease_s, total=run.total)
            version = session.get(ModelVersion, (run.model, run.version))
            retired = version is None or version.state == VersionState.retired
        if status is None:
            raise LeaseLost(run.id)
        if retired:
            # Its rows would be queued for a version no worker will serve again.
            raise VersionRetired(f"version_retired: {run.model}/{run.version} was retired; the rows not yet "
                                 f"answered were not run")
        run.status = status
        # Their lines are on disk and counted: the records are no longer needed.
        if run.checkpointed_ids:
            with translate_redis_errors():
                self.redis.delete(*(keys.job(job) for job in run.checkpointed_ids))
            run.checkpointed_ids.clear()

    def _release(self, run: _Run, owner: str) -> None:
        """Hand the batch back at once (the worker is shutting down): the next sweep re-sends it."""
        with self.registry.session() as session:
            queries.release(session, run.id, owner=owner, now=self._now())

    def _finish(self, run: _Run, owner: str, status: str, *, error: str | None = None) -> None:
        with self.registry.session() as session:
            if not queries.finish(session, run.id, owner=owner, status=status, now=self._now(), error=error):
                raise LeaseLost(run.id)
        log.info("batch %s %s: %d done, %d failed", run.id, status, run.done, run.failed)
        self.send_callbacks()

    # --- the sweep ----------------------------------------------------------------------------------

    def send_callbacks(self) -> int:
        """Queue the webhook of every finished batch that has one and has not had it queued. The
        delivery id is the batch's, so a second queueing is one delivery all the same."""
        with self.registry.session() as session:
            pending = queries.undelivered_callbacks(session)
            if pending:
                with translate_redis_errors():
                    pipe = self.redis.pipeline(transaction=False)
                    for batch_id in pending:
                        pipe.xadd(keys.WEBHOOK_OUTBOX,
                                  OutboxEntry(callback_delivery_id(batch_id), batch_id).to_fields())  # type: ignore[arg-type]
                    pipe.execute()
                queries.mark_callback_sent(session, pending)
        return len(pending)
