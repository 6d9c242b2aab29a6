"""Admission control: load shedding per version, then the tenant's quota and rate limit, then the
enqueue.

Every refusal is a 429 with `Retry-After`. The shedding rule is a pure function of the backlog,
the measured service rate and the latency budget, so the simulator and tests use it unchanged;
the I/O around it (one Redis round trip, cached for a fraction of a second) lives in `Admission`.
Shedding runs first and in process; the quota and rate limit are checked and charged in the
enqueue script itself (`sluice.quota`), so a job refused for any reason takes no rate tokens and
concurrent submissions cannot overrun the quota.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import redis.asyncio as aioredis

from sluice import heartbeats, keys
from sluice.broker import Broker
from sluice.connections import translate_redis_errors
from sluice.errors import TooManyRequests
from sluice.idempotency import IdempotencyClaim
from sluice.jobs import JobRecord
from sluice.quota import Refusal, TenantLimits
from sluice.registry.queries import KeyInfo
from sluice.routing import VersionInfo


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
    def __init__(self, *, redis: aioredis.Redis, broker: Broker, load_cache_s: float = 0.25,
                 clock: Callable[[], float] = time.time) -> None:
        self.redis = redis
        self.broker = broker
        self.load_cache_s = load_cache_s
        self.clock = clock
        self._loads: dict[tuple[str, str], _Load] = {}
        self._reading: dict[tuple[str, str], asyncio.Task[_Load]] = {}
        self._admitted: Counter[tuple[str, str]] = Counter()
        self._unwritten: Counter[tuple[str, str]] = Counter()

    async def queue(self, key: KeyInfo, version: VersionInfo, records: Sequence[JobRecord], *,
                    idempotency: IdempotencyClaim | None = None) -> None:
        """Queue one submission's jobs (one lane of `version`), or raise TooManyRequests.

        Jobs answered from the response cache (`cache_hit`) are written with the others but cost
        no worker time: they are never shed, and a submission of hits alone never waits for a load
        read."""
        lane, count = records[0].lane, sum(1 for record in records if not record.cache_hit)
        if count:
            await self.shed(version, lane=lane, count=count)
        refusal: Refusal | None = None
        queued = False
        try:
            refusal = await self.broker.enqueue(records, idempotency=idempotency, limits=TenantLimits(
                tenant=key.tenant, rate_per_s=key.rate_limit_per_s,
                # A submission larger than the burst could never pass otherwise.
                burst=max(key.rate_burst, count), max_queued=key.max_queued))
            queued = refusal is None
        finally:
            self.written(version, lane=lane, count=count, queued=queued)
        if refusal is not None:
            raise _refused(key, refusal)

    async def shed(self, version: VersionInfo, *, lane: str, count: int) -> None:
        """Raise TooManyRequests if `count` more jobs on `lane` would wait past the version's budget;
        otherwise count them as admitted until `written` says what became of them."""
        if lane == "online":
            await self._shed(version, count)

    def written(self, version: VersionInfo, *, lane: str, count: int, queued: bool = True) -> None:
        """The jobs `shed` admitted are in the stream, or (`queued` False) never will be."""
        if lane == "online":
            self._unwritten[(version.model, version.version)] -= count
            if not queued:
                self._admitted[(version.model, version.version)] -= count

    async def load(self, model: str, version: str) -> _Load:
        """The version's load, read at most every `load_cache_s`. Submissions that find it stale
        while a read is under way wait for that read: each starting its own, a burst made one
        backlog read per request instead of one per interval."""
        now = self.clock()
        key = (model, version)
        cached = self._loads.get(key)
        if cached is not None and now - cached.read_at < self.load_cache_s:
            return cached
        reading = self._reading.get(key)
        if reading is None:
            # The counts as the read begins, taken before the task first runs: what is admitted
            # from here on may be missing from the backlog it reads.
            reading = self._reading[key] = asyncio.create_task(
                self._read(model, version, now, mark=self._admitted[key], unwritten=self._unwritten[key]))
            reading.add_done_callback(partial(self._read_done, key))
        # Shielded: a request that goes away must not cancel the read the others wait for.
        return await asyncio.shield(reading)

    def _read_done(self, key: tuple[str, str], reading: asyncio.Task[_Load]) -> None:
        del self._reading[key]
        if not reading.cancelled():
            reading.exception()  # retrieved here: its waiters may all have gone

    async def _read(self, model: str, version: str, now: float, *, mark: int, unwritten: int) -> _Load:
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


def _refused(key: KeyInfo, refusal: Refusal) -> TooManyRequests:
    if refusal.reason == "quota":
        return TooManyRequests(f"tenant '{key.tenant}' has {refusal.queued} queued jobs; its quota is {key.max_queued}",
                               headers={"Retry-After": "5"})
    return TooManyRequests(f"tenant '{key.tenant}' is over its rate limit of {key.rate_limit_per_s:g} jobs/s",
                           headers={"Retry-After": str(max(1, math.ceil(refusal.wait_s)))})
