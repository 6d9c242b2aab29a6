"""The job record and its state transitions, as stored in Redis.

A job lives in one hash (`keys.job`). Transitions happen in small Lua scripts so that a
cancel racing a worker, or a job delivered twice, still ends with exactly one final record:
a final state is never overwritten.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any


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
            fields["output"] = json.dumps(self.output, separators=(",", ":"))
        if self.finished_at is not None:
            fields["finished_at"] = repr(self.finished_at)
        if self.shadow:
            fields["shadow"] = self.shadow
        if self.shadow_of:
            fields["shadow_of"] = self.shadow_of
        return fields

    def stream_entry(self) -> dict[str, str]:
        """What the version's stream carries: enough to batch without reading the record."""
        entry = {"id": self.id, "tenant": self.tenant, "cost": str(self.cost), "t": repr(self.enqueued_at)}
        if self.shadow:
            entry["sh"] = self.shadow
        if self.shadow_of:
            entry["so"] = self.shadow_of
        return entry

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
            output=obj("output"),
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


# Every script that makes a job final ends with this: a job submitted with a callback_url gets
# its webhook queued on the outbox stream (`keys.WEBHOOK_OUTBOX`) in the same atomic step as its
# final state, so no crash can keep one without the other, and since a final state is written
# only once, a job processed twice still queues one delivery. The delivery id is derived from the
# job id: one job, one delivery id, whoever computes it.
_QUEUE_WEBHOOK = """
local function queue_webhook(job, outbox)
  if redis.call('HEXISTS', job, 'callback_url') == 0 then return end
  local id = redis.call('HGET', job, 'id')
  local delivery = 'dlv_' .. string.sub(redis.sha1hex('sluice-webhook:' .. id), 1, 32)
  redis.call('HSET', job, 'delivery_id', delivery)
  redis.call('XADD', outbox, '*', 'delivery', delivery, 'job', id)
end
"""

# KEYS[1] job hash, KEYS[2] the tenant's queued counter, KEYS[3] the webhook outbox; ARGV: now,
# worker, max_deliveries. Moves queued/running -> running and hands back the input. A job already
# final answers its state and is not re-run; one past its deadline becomes `expired`, one
# delivered max_deliveries times becomes `failed` (the caller dead-letters it).
CLAIM_SCRIPT = _QUEUE_WEBHOOK + """
local s = redis.call('HGET', KEYS[1], 'status')
if not s then return {'missing'} end
if s ~= 'queued' and s ~= 'running' then return {s} end
if s == 'queued' and tonumber(redis.call('DECR', KEYS[2])) < 0 then redis.call('SET', KEYS[2], 0) end
local deadline = tonumber(redis.call('HGET', KEYS[1], 'deadline') or '')
if deadline and tonumber(ARGV[1]) > deadline then
  redis.call('HSET', KEYS[1], 'status', 'expired', 'finished_at', ARGV[1],
    'error', '{"code":"expired","message":"the job deadline passed before it started"}')
  queue_webhook(KEYS[1], KEYS[3])
  return {'expired'}
end
local attempts = tonumber(redis.call('HGET', KEYS[1], 'attempts') or '0')
if attempts >= tonumber(ARGV[3]) then
  local last = redis.call('HGET', KEYS[1], 'last_error') or 'its worker died while running it'
  redis.call('HSET', KEYS[1], 'status', 'failed', 'finished_at', ARGV[1],
    'error', cjson.encode({code='max_deliveries',
      message='delivered ' .. attempts .. ' times without finishing; last error: ' .. last}))
  queue_webhook(KEYS[1], KEYS[3])
  return {'dead', last}
end
redis.call('HSET', KEYS[1], 'status', 'running', 'worker', ARGV[2])
redis.call('HINCRBY', KEYS[1], 'attempts', 1)
return {'run', redis.call('HGET', KEYS[1], 'input'), tostring(attempts + 1)}
"""

# KEYS[1] job hash, KEYS[2] the webhook outbox; ARGV: status, output-or-'', error-or-'',
# finished_at, model_ms, batch_size, close_reason, ttl_s, started_at. Writes the outcome once; a
# second delivery of a finished job is a no-op, so a job processed twice still has one final
# record (and one webhook).
FINISH_SCRIPT = _QUEUE_WEBHOOK + """
local s = redis.call('HGET', KEYS[1], 'status')
if not s then return 0 end
if s ~= 'queued' and s ~= 'running' then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'finished_at', ARGV[4], 'model_ms', ARGV[5],
  'batch_size', ARGV[6], 'close_reason', ARGV[7], 'started_at', ARGV[9])
if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], 'output', ARGV[2]) end
if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'error', ARGV[3]) end
queue_webhook(KEYS[1], KEYS[2])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[8]))
return 1
"""

# KEYS[1] job hash; ARGV: message. Remembered so that dead-lettering can say why.
NOTE_ERROR_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'last_error', ARGV[1]) end
return 1
"""

# KEYS[1] job hash, KEYS[2] the tenant's queued counter, KEYS[3] the webhook outbox; ARGV: now.
# Only a queued job can be cancelled: answers 'ok', or the state that prevents it (an already
# cancelled job included).
CANCEL_SCRIPT = _QUEUE_WEBHOOK + """
local s = redis.call('HGET', KEYS[1], 'status')
if not s then return 'missing' end
if s ~= 'queued' then return s end
if tonumber(redis.call('DECR', KEYS[2])) < 0 then redis.call('SET', KEYS[2], 0) end
redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finished_at', ARGV[1])
queue_webhook(KEYS[1], KEYS[3])
return 'ok'
"""
