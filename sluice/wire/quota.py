"""A tenant's admission records in Redis: its rate bucket (`keys.rate_bucket`) and its queued jobs
(`keys.queued_jobs`), with the script that checks and charges both (`ADMIT_SCRIPT`).

Both, and the tenant's Idempotency-Keys, carry the tag `{tenant}`: one slot. A submission is
checked and charged there in one atomic step before its jobs are written (in their version's slot,
`sluice.wire.streams.QUEUE_SCRIPT`): concurrent submissions cannot all pass a quota they each read
before any of them was counted, and a refused submission takes no rate tokens.

The surprising part: the quota is a sorted set of job ids, not a counter. A member's score is
when its place frees on its own: the job's deadline, or the expiry of its record if that comes
first. The script drops members past their score before counting; the process that moves a job
out of `queued` (a worker's claim, a cancel) removes its member just after (`streams.free_places`).
So a place whose job never leaves `queued`, or whose remover died, or whose submission died before
its jobs were written, is held no longer than the job's record would live, and nothing leaks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from sluice.wire import keys
from sluice.wire.jobs import JobRecord

# Lua functions of the admission script; both take the time as the caller's clock says it.
TENANT_LUA = """
-- Takes `cost` tokens from the bucket at `key` (refilled at `rate` a second up to `burst`).
-- Answers nil, or the seconds until there are enough; a refusal leaves the bucket as it was.
local function take_tokens(key, rate, burst, now, cost)
  local state = redis.call('HMGET', key, 'tokens', 'ts')
  local tokens = tonumber(state[1]) or burst
  local ts = tonumber(state[2]) or now
  tokens = math.min(burst, tokens + math.max(0, now - ts) * rate)
  if tokens < cost then return (cost - tokens) / rate end
  redis.call('HSET', key, 'tokens', tostring(tokens - cost), 'ts', tostring(now))
  redis.call('EXPIRE', key, math.ceil(burst / rate) + 1)
  return nil
end

-- The number of the tenant's queued jobs, once those whose place has freed on its own are dropped.
local function queued_jobs(key, now)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  return redis.call('ZCARD', key)
end
"""

# KEYS[1] the tenant's queued set, KEYS[2] its rate bucket, KEYS[3] the Idempotency-Key when ARGV[6]
# is not ''. ARGV: now, max_queued, rate/s, burst, the queued set's ttl_s, the key's in-progress
# marker or '', the lease (ms) it is renewed for; then per job to queue its id and when its place
# frees (`frees_at`). Checks, then charges, in this order: the key is still this request's claim
# ({'lost'}), the quota ({'quota', queued jobs}), the rate ({'rate', seconds to wait}); then adds
# every place and renews the key's lease, so that it is still this request's when the jobs are
# written and the key completed: {'ok'}. A refusal charges nothing. A submission whose every job
# was answered from the response cache passes no job: only the key is checked.
ADMIT_SCRIPT = TENANT_LUA + """
local now = tonumber(ARGV[1])
if ARGV[6] ~= '' and redis.call('GET', KEYS[3]) ~= ARGV[6] then return {'lost'} end
local count = (#ARGV - 7) / 2
if count > 0 then
  local queued = queued_jobs(KEYS[1], ARGV[1])
  if queued + count > tonumber(ARGV[2]) then return {'quota', queued} end
  local wait = take_tokens(KEYS[2], tonumber(ARGV[3]), tonumber(ARGV[4]), now, count)
  if wait then return {'rate', tostring(wait)} end
  for i = 8, #ARGV, 2 do redis.call('ZADD', KEYS[1], ARGV[i + 1], ARGV[i]) end
  redis.call('EXPIRE', KEYS[1], ARGV[5])
end
if ARGV[6] ~= '' then redis.call('PEXPIRE', KEYS[3], ARGV[7]) end
return {'ok'}
"""

Verdict = Literal["ok", "lost", "quota", "rate"]


@dataclass(frozen=True, slots=True)
class TenantLimits:
    tenant: str
    rate_per_s: float
    burst: int
    max_queued: int


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why the enqueue script queued nothing: the tenant's quota (with `queued` jobs already), or
    its rate limit (with `wait_s` until the tokens are there)."""

    reason: Literal["quota", "rate"]
    queued: int = 0
    wait_s: float = 0.0


def frees_at(record: JobRecord, *, result_ttl_s: int) -> float:
    """When the job's place in the quota frees if it never leaves `queued`: past its deadline it
    can only expire, and past its record's TTL there is nothing left to run."""
    expiry = record.enqueued_at + result_ttl_s
    return expiry if record.deadline is None else min(record.deadline, expiry)


def admit_call(queued: Sequence[JobRecord], *, limits: TenantLimits, now: float, result_ttl_s: int,
               marker: str | None, redis_key: str | None, lease_s: float) -> tuple[list[str], list[str]]:
    """KEYS and ARGV of ADMIT_SCRIPT for the jobs of one submission that will be queued."""
    script_keys = [keys.queued_jobs(limits.tenant), keys.rate_bucket(limits.tenant)]
    args = [repr(now), str(limits.max_queued), repr(limits.rate_per_s), str(limits.burst), str(result_ttl_s)]
    if marker is None or redis_key is None:
        args += ["", "0"]
    else:
        script_keys.append(redis_key)
        args += [marker, str(max(1, int(lease_s * 1000)))]
    for record in queued:
        args += [record.id, repr(frees_at(record, result_ttl_s=result_ttl_s))]
    return script_keys, args


def verdict(reply: list[Any]) -> tuple[Verdict, float]:
    """ADMIT_SCRIPT's verdict, with the tenant's queued jobs (`quota`) or the seconds until its
    tokens are there (`rate`)."""
    name = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
    value = reply[1] if len(reply) > 1 else 0
    return cast(Verdict, name), float(value.decode() if isinstance(value, bytes) else value)
