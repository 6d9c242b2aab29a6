"""A tenant's admission records in Redis: its rate bucket (`keys.rate_bucket`) and its queued jobs
(`keys.queued_jobs`), with the Lua that checks and charges both.

They are checked and charged only inside the enqueue script (`sluice.streams.ENQUEUE_SCRIPT`), in
the same atomic step that writes the jobs: concurrent submissions cannot all pass a quota they
each read before any of them was counted, and a refused submission takes no rate tokens.

The surprising part: the quota is a sorted set of job ids, not a counter. A member's score is
when its place frees on its own: the job's deadline, or the expiry of its record if that comes
first. The script drops members past their score before counting; the claim and cancel scripts
remove a job that leaves `queued`. So a job that never leaves it (its record expired before any
worker read its entry) holds its place no longer than its record lives, and nothing leaks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sluice.jobs import JobRecord

# Lua functions for the scripts that admit jobs; both take the time as the caller's clock says it.
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
