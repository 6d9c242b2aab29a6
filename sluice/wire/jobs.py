"""The job record as stored in Redis (one hash, `keys.job`), and the job resource of the REST API.

The record is written whole at submission (`to_redis`) and read whole (`from_redis`); the fields a
job gains later are written by the transition scripts of `sluice.wire.streams`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

import orjson

from sluice.fair_share import DEFAULT_PRIORITY, DEFAULT_SHARE
from sluice.queue_standing import Standing
from sluice.references import INPUT_REF_FIELD, OUTPUT_REF_FIELD, WRITTEN_FIELD, InputRef, OutputRef, Written
from sluice.retry import RetryPolicy


class JobStatus(StrEnum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    expired = "expired"
    cancelled = "cancelled"


FINAL_STATES = frozenset(
    {JobStatus.succeeded, JobStatus.failed, JobStatus.expired, JobStatus.cancelled}
)


# The most jobs one `GET /v1/jobs?ids=` names: the API's limit, and the client's window.
MAX_WAIT_IDS = 256

# The one field read without the rest of the record: shadow copies compare with their primary's output.
OUTPUT_FIELD = "output"

# The tenant of shadow copies: not a valid tenant id (ids start with a letter or digit), so no
# key can ever read one, and copies never count against a real tenant's quota.
SHADOW_TENANT = "_shadow"


# The fields a job's owner reads back as they were stored: JSON already, copied into the resource
# rather than parsed and printed again (`JobView`), in the order the resource has them.
_COPIED_FIELDS = (OUTPUT_FIELD, "error", "metadata")


def _ms(start: float | None, end: float | None) -> float | None:
    if start is None or end is None:
        return None
    return round((end - start) * 1000.0, 3)


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, tz=UTC).isoformat(timespec="milliseconds")


@dataclass(slots=True)
class JobRecord:
    id: str
    tenant: str
    model: str
    version: str
    lane: str
    status: JobStatus
    input: dict[str, Any]
    enqueued_at: float
    cost: int = 0
    output: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    started_at: float | None = None
    finished_at: float | None = None
    model_ms: float | None = None
    batch_size: int | None = None
    close_reason: str | None = None
    callback_url: str | None = None
    deadline: float | None = None
    attempts: int = 0
    cache_hit: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)
    # Shadow traffic: `shadow` names the version a copy goes to once this job succeeds;
    # `shadow_of` marks the copy, which names its primary and is never shown to a tenant.
    shadow: str | None = None
    shadow_of: str | None = None
    # Set at submission when the version caches responses (`sluice.wire.response_cache`): where the
    # finish script stores this job's output once it succeeds, and for how long. Never shown.
    cache_key: str | None = None
    cache_ttl_s: int = 0
    # The submitting request's id (sluice.logs): the worker's log lines about the job carry it.
    request_id: str | None = None
    # The job's number in its lane, written by the queue script (`sluice.wire.keys.queue_added`):
    # how far it stands from the front is this less the highest number a worker has read.
    seq: int | None = None
    # Payloads by reference (sluice/references.py): the object the worker reads as the input (then
    # `input` is empty), where it writes the output (then `output` stays empty), and what it wrote.
    input_ref: InputRef | None = None
    output_ref: OutputRef | None = None
    written: Written | None = None
    # The longest a batch holding this job may run (workers/worker.py), and its retry policy
    # (`sluice.retry`, encoded); the errors of its earlier attempts, as the scripts append them:
    # [{"error": {...}, "at": unix seconds}].
    run_timeout_s: float | None = None
    retry: str | None = None
    attempt_errors: list[dict[str, Any]] = field(default_factory=list)
    # Written by the worker that ran it, only when the job woke its version from zero.
    cold_start_ms: float | None = None
    # Within its lane, 0 runs first; its tenant's weight in the lane's fair sharing (sluice/fair_share.py).
    priority: int = DEFAULT_PRIORITY
    share: float = DEFAULT_SHARE

    def to_redis(self) -> dict[str, str]:
        """Fields as written at submission; later fields are set by the transition scripts (a job
        answered from the response cache is final at submission, so it is written whole)."""
        fields = {
            "id": self.id,
            "tenant": self.tenant,
            "model": self.model,
            "version": self.version,
            "lane": self.lane,
            "status": self.status.value,
            "input": _json_text(self.input),
            "enqueued_at": repr(self.enqueued_at),
            "cost": str(self.cost),
            "attempts": str(self.attempts),
            "cache_hit": "1" if self.cache_hit else "0",
            "metadata": _json_text(self.metadata),
        }
        if self.callback_url:
            fields["callback_url"] = self.callback_url
        if self.deadline is not None:
            fields["deadline"] = repr(self.deadline)
        if self.output is not None:
            fields[OUTPUT_FIELD] = _json_text(self.output)
        if self.started_at is not None:
            fields["started_at"] = repr(self.started_at)
        if self.finished_at is not None:
            fields["finished_at"] = repr(self.finished_at)
        if self.shadow:
            fields["shadow"] = self.shadow
        if self.shadow_of:
            fields["shadow_of"] = self.shadow_of
        if self.cache_key and self.cache_ttl_s > 0:
            fields["cache_key"] = self.cache_key
            fields["cache_ttl_s"] = str(self.cache_ttl_s)
        if self.request_id:
            fields["request_id"] = self.request_id
        if self.input_ref is not None:
            fields[INPUT_REF_FIELD] = self.input_ref.encode()
        if self.output_ref is not None:
            fields[OUTPUT_REF_FIELD] = self.output_ref.encode()
        if self.written is not None:
            fields[WRITTEN_FIELD] = self.written.encode()
        if self.run_timeout_s is not None:
            fields["run_timeout_s"] = repr(self.run_timeout_s)
        if self.retry:
            fields["retry"] = self.retry
        if self.cold_start_ms is not None:
            fields["cold_start_ms"] = repr(self.cold_start_ms)
        if self.priority != DEFAULT_PRIORITY:
            fields["priority"] = str(self.priority)
        if self.share != DEFAULT_SHARE:
            fields["share"] = repr(self.share)
        return fields

    @classmethod
    def from_redis(cls, raw: dict[Any, Any]) -> JobRecord:
        data = _decoded(raw)

        def num(name: str) -> float | None:
            value = data.get(name)
            return float(value) if value not in (None, "") else None

        def obj(name: str) -> Any:
            value = data.get(name)
            return json.loads(value) if value else None

        batch_size = data.get("batch_size")
        return cls(
            id=data["id"],
            tenant=data["tenant"],
            model=data["model"],
            version=data["version"],
            lane=data.get("lane", "online"),
            status=JobStatus(data["status"]),
            input=obj("input") or {},
            enqueued_at=float(data["enqueued_at"]),
            cost=int(data.get("cost") or 0),
            output=obj(OUTPUT_FIELD),
            error=obj("error"),
            started_at=num("started_at"),
            finished_at=num("finished_at"),
            model_ms=num("model_ms"),
            batch_size=int(batch_size) if batch_size else None,
            close_reason=data.get("close_reason") or None,
            callback_url=data.get("callback_url") or None,
            deadline=num("deadline"),
            attempts=int(data.get("attempts") or 0),
            cache_hit=data.get("cache_hit") == "1",
            metadata=obj("metadata") or {},
            shadow=data.get("shadow") or None,
            shadow_of=data.get("shadow_of") or None,
            cache_key=data.get("cache_key") or None,
            cache_ttl_s=int(data.get("cache_ttl_s") or 0),
            request_id=data.get("request_id") or None,
            seq=int(data["seq"]) if data.get("seq") else None,
            input_ref=InputRef.parse(data.get(INPUT_REF_FIELD)),
            output_ref=OutputRef.parse(data.get(OUTPUT_REF_FIELD)),
            written=Written.parse(data.get(WRITTEN_FIELD)),
            run_timeout_s=num("run_timeout_s"),
            retry=data.get("retry") or None,
            attempt_errors=obj("attempt_errors") or [],
            cold_start_ms=num("cold_start_ms"),
            priority=int(data.get("priority") or DEFAULT_PRIORITY),
            share=num("share") or DEFAULT_SHARE,
        )

    @property
    def is_final(self) -> bool:
        return self.status in FINAL_STATES

    @property
    def lane_key(self) -> tuple[str, str, str]:
        """(model, version, lane): where the job queues."""
        return self.model, self.version, self.lane

    def resource(self, standing: Standing | None = None) -> dict[str, Any]:
        """The job resource of the REST contract (`api/response_models.py`, `JobResource`), with a
        queued job's `standing` when there is one."""
        body: dict[str, Any] = {
            "id": self.id,
            "status": self.status.value,
            "model": self.model,
            "version": self.version,
            "lane": self.lane,
            "priority": self.priority,
            "cache_hit": self.cache_hit,
            "attempts": self.attempts,
            "timings": {
                "enqueued_at": _iso(self.enqueued_at),
                "started_at": _iso(self.started_at),
                "finished_at": _iso(self.finished_at),
                "queue_wait_ms": _ms(self.enqueued_at, self.started_at),
                "model_ms": self.model_ms,
                "total_ms": _ms(self.enqueued_at, self.finished_at),
            },
            "batch": {"size": self.batch_size, "close_reason": self.close_reason},
        }
        # Before the copied fields, in the order JobView.body() adds them after these.
        if self.input_ref is not None:
            body["input_uri"] = self.input_ref.uri
        if self.output_ref is not None:
            body["output_uri"] = self.output_ref.uri
        if self.written is not None:
            body["output_size"] = self.written.size
            body["output_sha256"] = self.written.sha256
        if self.deadline is not None:
            body["start_by"] = _iso(self.deadline)
        if self.run_timeout_s is not None:
            body["run_timeout_s"] = self.run_timeout_s
        policy = RetryPolicy.parse(self.retry)
        if policy is not None:
            body["retry"] = {"max_attempts": policy.max_attempts, "on": list(policy.on)}
        if self.attempt_errors:
            body["attempt_errors"] = [{"attempt": number, "error": each.get("error"), "at": _iso(each.get("at"))}
                                      for number, each in enumerate(self.attempt_errors, start=1)]
        if self.cold_start_ms is not None:
            body["timings"]["cold_start_ms"] = self.cold_start_ms
        if self.output is not None:
            body["output"] = self.output
        if self.error is not None:
            body["error"] = self.error
        if self.metadata:
            body["metadata"] = self.metadata
        if standing is not None:
            body.update(queue_position=standing.queue_position, estimated_start_s=standing.estimated_start_s)
        return body


def _json_text(value: Any) -> str:
    """A request's value (an input, metadata) as compact JSON. orjson writes a bulk submission's
    texts several times faster than the standard encoder, but refuses integers past 64 bits, which
    a request body may carry: those go to the standard one."""
    try:
        return orjson.dumps(value).decode()
    except orjson.JSONEncodeError:
        return json.dumps(value, separators=(",", ":"))


def _decoded(raw: dict[Any, Any]) -> dict[str, Any]:
    return {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in raw.items()}


def _without_non_finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _without_non_finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_without_non_finite(item) for item in value]
    return value


def _copied(text: str) -> Any:
    """A stored JSON field as the resource carries it. Python's encoder (a worker's) writes a
    non-finite float as the bare word NaN or Infinity, which no JSON reader takes: a field that may
    hold one is parsed, and such numbers answered as null, as the response models did. Anything
    else (MiniLM's 384 floats: a 7 KB text) is copied as it is."""
    if "NaN" in text or "Infinity" in text:
        return _without_non_finite(json.loads(text))
    return orjson.Fragment(text)


@dataclass(frozen=True, slots=True)
class JobView:
    """A job as its owner reads it: whose it is, its status, and its resource as JSON bytes.

    The resource is built only when asked for (a long-poll reads a job that is not final yet only to
    learn so), and without parsing the input (not part of the resource) nor the output, error and
    metadata, which are JSON already and copied in: parsing an embedding's floats and printing
    them again was most of a job read's CPU. `body()` equals
    `orjson.dumps(JobRecord.from_redis(raw).resource())` (tests/unit/test_records.py).
    """

    id: str
    tenant: str
    status: JobStatus
    stored: dict[str, Any]

    @property
    def is_final(self) -> bool:
        return self.status in FINAL_STATES

    @classmethod
    def from_redis(cls, raw: dict[Any, Any]) -> JobView:
        data = _decoded(raw)
        return cls(id=data["id"], tenant=data["tenant"], status=JobStatus(data["status"]), stored=data)

    @property
    def seq(self) -> int | None:
        """The job's number in its lane (`JobRecord.seq`)."""
        return int(self.stored["seq"]) if self.stored.get("seq") else None

    @property
    def lane_key(self) -> tuple[str, str, str]:
        return self.stored["model"], self.stored["version"], self.stored["lane"]

    @property
    def priority(self) -> int:
        return int(self.stored.get("priority") or DEFAULT_PRIORITY)

    @property
    def share(self) -> float:
        return float(self.stored.get("share") or DEFAULT_SHARE)

    def body(self, standing: Standing | None = None) -> bytes:
        data = dict(self.stored)
        copied = {name: data.pop(name, "") for name in ("input", *_COPIED_FIELDS)}
        resource = JobRecord.from_redis(data).resource(standing)
        for name in _COPIED_FIELDS:
            # As `resource()`: an output or error when there is one, metadata when it is not empty.
            if copied[name] and (name != "metadata" or copied[name] != "{}"):
                resource[name] = _copied(copied[name])
        return orjson.dumps(resource)
