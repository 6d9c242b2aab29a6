"""What a version's streams carry: a lane's entry (enough to batch without reading the job record),
an entry as the group delivered it, and a dead letter. The codec of both streams' fields."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sluice.fair_share import DEFAULT_PRIORITY, DEFAULT_SHARE
from sluice.vocabulary import Lane
from sluice.wire.connections import reply_text
from sluice.wire.jobs import JobRecord


@dataclass(frozen=True, slots=True)
class StreamEntry:
    """What a lane's stream carries: enough to batch without reading the job record."""

    job_id: str
    tenant: str
    cost: int
    enqueued_at: float
    shadow: str | None = None  # copy the input to this version once the job succeeds
    shadow_of: str | None = None  # this job is a shadow copy of that primary job
    request_id: str | None = None
    # The job's number in its lane (`sluice.wire.keys.queue_added`), given by the queue script.
    seq: int | None = None
    # The job's own run limit and retry policy (`JobRecord`), which the worker applies.
    run_timeout_s: float | None = None
    retry: str | None = None
    priority: int = DEFAULT_PRIORITY
    # The tenant's weight in its lane's fair sharing (sluice/fair_share.py), as its key carried it.
    share: float = DEFAULT_SHARE

    @classmethod
    def of(cls, record: JobRecord) -> StreamEntry:
        return cls(job_id=record.id, tenant=record.tenant, cost=record.cost, enqueued_at=record.enqueued_at,
                   shadow=record.shadow, shadow_of=record.shadow_of, request_id=record.request_id, seq=record.seq,
                   run_timeout_s=record.run_timeout_s, retry=record.retry, priority=record.priority,
                   share=record.share)

    def to_fields(self) -> dict[str, str]:
        fields = {"id": self.job_id, "tenant": self.tenant, "cost": str(self.cost), "t": repr(self.enqueued_at)}
        if self.seq is not None:
            fields["sq"] = str(self.seq)
        if self.shadow:
            fields["sh"] = self.shadow
        if self.shadow_of:
            fields["so"] = self.shadow_of
        if self.request_id:
            fields["rq"] = self.request_id
        if self.run_timeout_s is not None:
            fields["rt"] = repr(self.run_timeout_s)
        if self.retry:
            fields["ry"] = self.retry
        if self.priority != DEFAULT_PRIORITY:
            fields["pr"] = str(self.priority)
        if self.share != DEFAULT_SHARE:
            fields["ws"] = repr(self.share)
        return fields

    @classmethod
    def from_fields(cls, fields: Mapping[bytes, bytes]) -> StreamEntry:
        return cls(job_id=fields[b"id"].decode(), tenant=fields[b"tenant"].decode(), cost=int(fields[b"cost"]),
                   enqueued_at=float(fields[b"t"]), shadow=reply_text(fields.get(b"sh")) or None,
                   shadow_of=reply_text(fields.get(b"so")) or None, request_id=reply_text(fields.get(b"rq")) or None,
                   seq=int(fields[b"sq"]) if b"sq" in fields else None,
                   run_timeout_s=float(fields[b"rt"]) if fields.get(b"rt") else None,
                   retry=reply_text(fields.get(b"ry")) or None,
                   priority=int(fields[b"pr"]) if b"pr" in fields else DEFAULT_PRIORITY,
                   share=float(fields[b"ws"]) if b"ws" in fields else DEFAULT_SHARE)


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """An entry of `keys.dead_stream`: a job given up after max_deliveries, with the last error.
    claim.lua writes these fields when it gives a job up."""

    job_id: str
    error: str
    at: float

    def to_fields(self) -> dict[str, str]:
        return {"id": self.job_id, "error": self.error[:500], "t": repr(self.at)}

    @classmethod
    def from_fields(cls, fields: Mapping[bytes, bytes]) -> DeadLetter:
        return cls(job_id=fields[b"id"].decode(), error=fields[b"error"].decode(), at=float(fields[b"t"]))


@dataclass(frozen=True, slots=True)
class Delivered:
    """An entry as the group delivered it to this consumer."""

    lane: Lane
    entry_id: str
    entry: StreamEntry
