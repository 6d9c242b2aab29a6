"""The job record as stored in Redis (one hash, `keys.job`), and the job resource of the REST API.

The record is written whole at submission (`to_redis`) and read whole (`from_redis`); the fields a
job gains later are written by the transition scripts of `sluice.streams`.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Literal, get_args


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

# Why a batch closed (DESIGN §3): full, its oldest job waited max_wait_ms, or the worker drained.
CloseReason = Literal["size", "age", "drain"]
CLOSE_REASONS: tuple[CloseReason, ...] = get_args(CloseReason)

# The one field read without the rest of the record: shadow copies compare with their primary's output.
OUTPUT_FIELD = "output"

# The tenant of shadow copies: not a valid tenant id (ids start with a letter or digit), so no
# key can ever read one, and copies never count against a real tenant's quota.
SHADOW_TENANT = "_shadow"


def new_job_id() -> str:
    # 128 bits from the OS CSPRNG: ids are unguessable, so knowing one is no way into another.
    return "job_" + secrets.token_urlsafe(16)


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

    def to_redis(self) -> dict[str, str]:
        """Fields as written at submission; later fields are set by the transition scripts."""
        fields = {
            "id": self.id,
            "tenant": self.tenant,
            "model": self.model,
            "version": self.version,
            "lane": self.lane,
            "status": self.status.value,
            "input": json.dumps(self.input, separators=(",", ":")),
            "enqueued_at": repr(self.enqueued_at),
            "cost": str(self.cost),
            "attempts": str(self.attempts),
            "cache_hit": "1" if self.cache_hit else "0",
            "metadata": json.dumps(self.metadata, separators=(",", ":")),
        }
        if self.callback_url:
            fields["callback_url"] = self.callback_url
        if self.deadline is not None:
            fields["deadline"] = repr(self.deadline)
        if self.output is not None:
            fields[OUTPUT_FIELD] = json.dumps(self.output, separators=(",", ":"))
        if self.finished_at is not None:
            fields["finished_at"] = repr(self.finished_at)
        if self.shadow:
            fields["shadow"] = self.shadow
        if self.shadow_of:
            fields["shadow_of"] = self.shadow_of
        return fields

    @classmethod
    def from_redis(cls, raw: dict[Any, Any]) -> JobRecord:
        data = {
            (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in raw.items()
        }

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
        )

    @property
    def is_final(self) -> bool:
        return self.status in FINAL_STATES

    def resource(self) -> dict[str, Any]:
        """The job resource of the REST contract (DESIGN §6)."""
        body: dict[str, Any] = {
            "id": self.id,
            "status": self.status.value,
            "model": self.model,
            "version": self.version,
            "lane": self.lane,
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
        if self.output is not None:
            body["output"] = self.output
        if self.error is not None:
            body["error"] = self.error
        if self.metadata:
            body["metadata"] = self.metadata
        return body
