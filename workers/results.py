"""Storing a batch's outcomes: each job's final state, its sample, its event, its shadow copy.

The whole batch is one script call (sluice/wire/lua/finish.lua), one round trip: only the write that
makes a job final counts, and the outcome, sample, event and shadow copy of that write are one
atomic step, so a job run twice (its entry taken over from a worker that stalled) still has one of
each, and the copy is made exactly when the primary's outcome is. Entries are acknowledged in the
same step, after the outcomes: a job is never acknowledged before its outcome is stored.

An input whose run faulted (not the input's failure, see workers/execution.py) gets no outcome and
its entry is not acknowledged: the fault is noted on the job for its dead letter, and the entry is
left for another delivery. A shadow copy's own sample carries its agreement with the primary, read
before the batch is stored (one more round trip, for batches of a shadow version only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypedDict

import orjson

from sluice.batcher import Batch, Item
from sluice.cost import PassUsage
from sluice.metrics import SHADOW_COPIES
from sluice.quality import agreement, proxies
from sluice.references import InputRef, OutputRef
from sluice.retry import RetryPolicy
from sluice.vocabulary import Lane
from sluice.wire import keys
from sluice.wire.connections import translate_redis_errors
from sluice.wire.entries import Delivered
from sluice.wire.jobs import OUTPUT_FIELD, SHADOW_TENANT, JobRecord, JobStatus
from sluice.wire.samples import Sample
from sluice.wire.script_calls import Claim, Finished
from sluice.wire.streams import StreamConsumer
from workers.execution import Outcome


@dataclass(frozen=True, slots=True)
class Delivery:
    """What the batcher carries as an item's payload: a claimed job, ready to run."""

    job_id: str
    lane: Lane
    input: dict[str, Any]
    attempts: int
    shadow: str | None = None  # copy the input to this version once the job succeeds
    shadow_of: str | None = None  # this job is a shadow copy of that primary job
    # When this worker handed it to the batcher: a batch's fill time runs from its first arrival.
    arrived_at: float = 0.0
    request_id: str | None = None
    # A job by reference (sluice/references.py): `input` is empty until workers/references.py reads it.
    input_ref: InputRef | None = None
    output_ref: OutputRef | None = None
    run_timeout_s: float | None = None  # the job's own limit on its batch's run
    retry: RetryPolicy | None = None

    @classmethod
    def claimed(cls, delivered: Delivered, claim: Claim, *, arrived_at: float) -> Delivery:
        """The job of a stream entry that its claim lets run here."""
        entry = delivered.entry
        return cls(job_id=entry.job_id, lane=delivered.lane, input=claim.input, attempts=claim.attempts,
                   shadow=entry.shadow, shadow_of=entry.shadow_of, arrived_at=arrived_at,
                   request_id=entry.request_id, input_ref=claim.input_ref, output_ref=claim.output_ref,
                   run_timeout_s=entry.run_timeout_s, retry=RetryPolicy.parse(entry.retry))


def _json(value: dict[str, Any] | None) -> bytes:
    # orjson: a 384-float embedding took ~0.3 ms with json.dumps, the largest share of a single
    # job's worker CPU outside the model; the stored text is the same JSON value.
    return orjson.dumps(value) if value is not None else b""


class _Share(TypedDict, total=False):
    fill_ms: float
    padded_tokens: float
    real_tokens: float
    core_s: float
    gpu_s: float
    idle_s: float


def _share(batch: Batch[Delivery], usage: PassUsage | None) -> _Share:
    """Each job's share of its pass, as `Sample` fields."""
    size = len(batch.items)
    fill_ms = round(max(0.0, batch.closed_at - min(item.payload.arrived_at for item in batch.items)) * 1000, 3)
    if usage is None:
        return {"fill_ms": fill_ms}
    return {"fill_ms": fill_ms, "padded_tokens": usage.padded_tokens / size, "real_tokens": usage.real_tokens / size,
            "core_s": usage.core_s / size, "gpu_s": usage.gpu_s / size, "idle_s": usage.idle_s / size}


class ResultWriter:
    def __init__(self, *, streams: StreamConsumer, result_ttl_s: int, woke_at: float | None = None) -> None:
        self.streams = streams
        # When this worker, the first of a version woken from zero, became ready: a job queued
        # before then waited for it to start (its `cold_start_ms`).
        self.woke_at = woke_at
        self.redis = streams.redis
        self.model = streams.model
        self.version = streams.version
        self.result_ttl_s = result_ttl_s
        self._copies = SHADOW_COPIES.labels(self.model, self.version)

    async def store(self, batch: Batch[Delivery], outcomes: list[Outcome], *, started: float, finished: float,
                    model_ms: float, usage: PassUsage | None = None) -> list[bool]:
        """Store and acknowledge; answer, per item, whether this write made its job final. `usage`:
        what the pass used, shared equally by its jobs' samples (sluice/cost.py)."""
        size = len(batch.items)
        primaries = await self._primary_outputs(batch, outcomes)
        share = _share(batch, usage)
        jobs = [self._finished(item, outcome, primaries, started=started, finished=finished, model_ms=model_ms,
                               size=size, close_reason=batch.close_reason, share=share)
                for item, outcome in zip(batch.items, outcomes, strict=True) if outcome.fault is None]
        faults = [(item.payload.job_id, outcome.fault) for item, outcome in zip(batch.items, outcomes, strict=True)
                  if outcome.fault is not None]
        won = await self.streams.finish(jobs, faults=faults, started=started, finished=finished, model_ms=model_ms,
                                        batch_size=size, close_reason=batch.close_reason)
        winners = [job for job, first in zip(jobs, won, strict=True) if first]
        copies = sum(1 for job in winners if job.copy is not None)
        if copies:
            self._copies.inc(copies)
        won_entries = {job.entry_id for job in winners}
        return [item.id in won_entries for item in batch.items]

    def _finished(self, item: Item[Delivery], outcome: Outcome, primaries: dict[str, dict[str, Any]], *,
                  started: float, finished: float, model_ms: float, size: int, close_reason: str,
                  share: _Share) -> Finished:
        delivery = item.payload
        status = JobStatus.succeeded if outcome.error is None else JobStatus.failed
        retried = (outcome.error is not None and delivery.retry is not None
                   and delivery.retry.requeues(error_code=outcome.error.get("code"), attempts=delivery.attempts))
        # An output written to its output_uri is not stored again: the record keeps its size and sha256.
        output = b"" if outcome.written is not None else _json(outcome.output)
        encoded_size = outcome.written.size if outcome.written is not None else len(output)
        quality: dict[str, Any] = {}
        if outcome.error is None:
            quality = {**proxies(outcome.output, encoded_size=encoded_size), **(outcome.proxies or {})}
            primary = primaries.get(delivery.shadow_of or "")
            if primary is not None and outcome.output is not None:
                agreed = agreement(primary, outcome.output)
                if agreed is not None:
                    quality["agreement"] = agreed
        sample = Sample(
            status=status.value, finished_at=finished, queue_wait_ms=round((started - item.enqueued_at) * 1000, 3),
            model_ms=model_ms, total_ms=round((finished - item.enqueued_at) * 1000, 3), batch_size=size,
            close_reason=close_reason, quality=quality, **share,
        )
        copy = (self._shadow_copy(delivery, item.cost, finished)
                if delivery.shadow and outcome.output is not None else None)
        # A shadow copy's state is nobody's to wait for: only primaries announce theirs.
        cold = (round((self.woke_at - item.enqueued_at) * 1000, 3)
                if self.woke_at is not None and item.enqueued_at < self.woke_at else None)
        return Finished(job_id=delivery.job_id, lane=delivery.lane, entry_id=item.id,
                        status=JobStatus.queued.value if retried else status.value,
                        output=output, error=_json(outcome.error), sample=sample,
                        announce=not delivery.shadow_of, copy=copy,
                        written=outcome.written.encode() if outcome.written is not None else "",
                        cold_start_ms=cold)

    async def _primary_outputs(self, batch: Batch[Delivery], outcomes: list[Outcome]) -> dict[str, dict[str, Any]]:
        """The primary outputs that shadow copies in this batch are compared with."""
        wanted = [item.payload.shadow_of for item, outcome in zip(batch.items, outcomes, strict=True)
                  if item.payload.shadow_of and outcome.output is not None]
        if not wanted:
            return {}
        with translate_redis_errors():
            pipe = self.redis.pipeline(transaction=False)
            for job_id in wanted:
                pipe.hget(keys.job(job_id), OUTPUT_FIELD)
            replies = await pipe.execute()
        return {job_id: orjson.loads(raw) for job_id, raw in zip(wanted, replies, strict=True) if raw}

    def _shadow_copy(self, delivery: Delivery, cost: int, now: float) -> JobRecord:
        """The copy of a job for its shadow version, queued once the job's write wins (`StreamConsumer.finish`)."""
        shadow = str(delivery.shadow)
        return JobRecord(
            id=keys.new_job_id(self.model, shadow), tenant=SHADOW_TENANT, model=self.model, version=shadow,
            lane="bulk", status=JobStatus.queued, input=delivery.input, cost=cost, enqueued_at=now,
            shadow_of=delivery.job_id, request_id=delivery.request_id,
        )
