"""Admission control: per-tenant rate limit and queued-job quota, and load shedding per version.

Every refusal is a 429 with `Retry-After`. The shedding rule is a pure function of the backlog,
the measured service rate and the latency budget, so the simulator and tests use it unchanged;
the I/O around it (one Redis round trip, cached for a fraction of a second) lives in `Admission`.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis

from sluice import heartbeats, keys
from sluice.connections import translate_redis_errors
from sluice.errors import TooManyRequests
from sluice.registry.queries import KeyInfo
from sluice.routing import VersionInfo

# KEYS[1] the tenant's bucket; ARGV: rate/s, burst, now, cost. Answers {1} or {0, wait seconds}.
TOKEN_BUCKET_SCRIPT = """
local rate, burst, now, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1]) or burst
local ts = tonumber(state[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - ts) * rate)
local ttl = math.ceil(burst / rate) + 1
if tokens >= cost then
  redis.call('HSET', KEYS[1], 'tokens', tostring(tokens - cost), 'ts', tostring(now))
  redis.call('EXPIRE', KEYS[1], ttl)
  return {1}
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
redis.call('EXPIRE', KEYS[1], ttl)
return {0, tostring((cost - tokens) / rate)}
"""


def shed_retry_after(*, backlog: int, service_rate: float, budget_s: float) -> float | None:
    """Seconds to wait if a new job would wait past its budget, else None.

    The predicted wait is backlog / service rate. With no measured rate (no warm worker has
    finished a batch yet) nothing is shed: refusing on a guess would turn a cold start into an
    outage.
    """
    if service_rate <= 0 or backlog <= 0:
        return None
    predicted = backlog / service_rate
    if predicted <= budget_s:
        return None
    return predicted - budget_s


@dataclass(frozen=True, slots=True)
class _Load:
    backlog: int
    service_rate: float
    live_workers: int
    read_at: float
    # What this replica had admitted, and had admitted but not yet written to the stream, when
    # the read began: neither may be in `backlog`, so both are added on top (a job counted twice
    # only makes shedding start a little early).
    admitted_mark: int = 0
    unwritten: int = 0


class Admission:
    def __init__(self, *, redis: aioredis.Redis, load_cache_s: float = 0.25,
                 clock: Callable[[], float] = time.time) -> None:
        self.redis = redis
        self.load_cache_s = load_cache_s
        self.clock = clock
        self._bucket = redis.register_script(TOKEN_BUCKET_SCRIPT)
        self._loads: dict[tuple[str, str], _Load] = {}
        self._admitted: Counter[tuple[str, str]] = Counter()
        self._unwritten: Counter[tuple[str, str]] = Counter()

    async def admit(self, key: KeyInfo, version: VersionInfo, *, lane: str, count: int) -> None:
        """Admit `count` jobs or raise TooManyRequests; after admitting, call `written` once the
        jobs are in the stream (or failed to get there)."""
        await self._rate_limit(key, count)
        await self._quota(key, count)
        if lane == "online":
            await self._shed(version, count)

    def written(self, version: VersionInfo, *, lane: str, count: int) -> None:
        if lane == "online":
            self._unwritten[(version.model, version.version)] -= count

    async def _rate_limit(self, key: KeyInfo, count: int) -> None:
        burst = max(key.rate_burst, count)  # a bulk larger than the burst could never pass otherwise
        with translate_redis_errors():
            verdict = await self._bucket(keys=[keys.rate_bucket(key.tenant)],
                                         args=[key.rate_limit_per_s, burst, repr(self.clock()), count])
        if int(verdict[0]) == 0:
            wait = float(verdict[1])
            raise TooManyRequests(f"tenant '{key.tenant}' is over its rate limit of {key.rate_limit_per_s:g} jobs/s",
                                  headers={"Retry-After": str(max(1, math.ceil(wait)))})

    async def _quota(self, key: KeyInfo, count: int) -> None:
        with translate_redis_errors():
            queued = int(await self.redis.get(keys.queued_count(key.tenant)) or 0)
        if queued + count > key.max_queued:
            raise TooManyRequests(
                f"tenant '{key.tenant}' has {queued} queued jobs; its quota is {key.max_queued}",
                headers={"Retry-After": "5"},
            )

    async def load(self, model: str, version: str) -> _Load:
        now = self.clock()
        cached = self._loads.get((model, version))
        if cached is not None and now - cached.read_at < self.load_cache_s:
            return cached
        mark, unwritten = self._admitted[(model, version)], self._unwritten[(model, version)]
        # One after the other, on one pooled connection: read concurrently, a second connection
        # left stale by a Redis restart turns the first submission after it into a 503.
        backlog = await self._backlog(model, version)
        beats = await heartbeats.live_heartbeats(self.redis, model, version, now=now)
        load = _Load(backlog=backlog, service_rate=sum(beat.items_per_s for beat in beats),
                     live_workers=len(beats), read_at=now, admitted_mark=mark, unwritten=unwritten)
        self._loads[(model, version)] = load
        return load

    async def _backlog(self, model: str, version: str) -> int:
        with translate_redis_errors():
            return int(await self.redis.xlen(keys.stream(model, version, "online")))

    async def _shed(self, version: VersionInfo, count: int) -> None:
        key = (version.model, version.version)
        load = await self.load(*key)
        # No await from here to the count: concurrent requests that read the same snapshot each
        # see the others' admissions, so a burst cannot slip in on one stale backlog.
        unseen = load.unwritten + self._admitted[key] - load.admitted_mark
        wait = shed_retry_after(backlog=load.backlog + unseen + count, service_rate=load.service_rate,
                                budget_s=version.latency_budget_ms / 1000.0)
        if wait is None:
            self._admitted[key] += count
            self._unwritten[key] += count
            return
        budget_s = version.latency_budget_ms / 1000.0
        message = (f"version '{version.version}' of '{version.model}' is overloaded: the predicted queue wait "
                   f"exceeds its {version.latency_budget_ms:g} ms budget")
        if count / load.service_rate > budget_s:
            # Waiting cannot help: these jobs would overrun the budget behind an empty queue.
            message += (f" even with nothing queued ({count} jobs take {count / load.service_rate:.1f} s "
                        "at its measured rate)")
        raise TooManyRequests(
            f'{message}; submit batch work on the bulk lane ("lane": "bulk"), which is never shed',
            headers={"Retry-After": str(max(1, math.ceil(wait)))}, details={"retry_with": {"lane": "bulk"}},
        )
