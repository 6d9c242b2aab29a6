"""Admission control: load shedding per version, then the tenant's quota and rate limit, then the
enqueue.

Every refusal is a 429 with `Retry-After`. The shedding rule is a pure function of the backlog,
the measured service rate and the latency budget, so the simulator and tests use it unchanged;
the I/O around it (one Redis round trip, cached for a fraction of a second, but read afresh
for an admission near the budget, where other replicas' admissions matter) lives in `Admission`.
Shedding runs first and in process; the quota, the bound on stored answered jobs and the rate
limit are checked and charged in the enqueue script itself (`sluice.wire.quota`), so a job refused
for any reason takes no rate tokens and concurrent submissions cannot overrun the quota. Jobs
answered from the response cache are never shed, but pass the tenant's limits like the others.
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

from sluice.errors import StoredJobsLimit, TooManyRequests
from sluice.fair_share import DEFAULT_PRIORITY
from sluice.registry.tenants import KeyInfo
from sluice.routing import VersionInfo
from sluice.wire import heartbeats, keys
from sluice.wire.broker import Broker
from sluice.wire.connections import translate_redis_errors
from sluice.wire.idempotency import IdempotencyClaim
from sluice.wire.jobs import JobRecord
from sluice.wire.quota import Refusal, TenantLimits


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


# The share of the version's latency budget past which admission refuses a job of each priority: the
# lowest first. Priority 0 may queue past the budget, because the backlog it is predicted from is
# mostly of jobs it runs ahead of.
SHED_AT = {0: 2.0, 1: 1.0, 2: 0.5}


# Above this share of the budget, a cached load no longer admits on its own: the job waits for a
# backlog read that began after it arrived. Below it, the cache (`load_cache_s`) serves, and what
# other replicas admitted since it was read is unseen; each of them can admit at most this share
# of the budget on a view like that, so two replicas cannot push the queue past the budget
# between them, and every admission above it sees every other replica's written jobs.
FRESH_ABOVE = 0.5


@dataclass(frozen=True, slots=True)
class Load:
    backlog: int
    service_rate: float
    live_workers: int
    read_at: float
    # How fast the live workers drain a backlog (their rates over passes run with more work waiting,
    # each worker's plain rate until it has one): what a queued job's estimated start divides by.
    backlog_rate: float = 0.0
    # The entries the live workers hold (read, not yet acknowledged), per lane: in front of every
    # queued job of the lane, though its position no longer counts them.
    held_online: int = 0
    held_bulk: int = 0
    # What this replica had admitted, and had admitted but not yet written to the stream, when
    # the read began: neither may be in `backlog`, so both are added on top (a job counted twice
    # only makes shedding start a little early).
    admitted_mark: int = 0
    unwritten: int = 0


class Admission:
    def __init__(self, *, redis: aioredis.Redis, broker: Broker, max_answered_jobs: int,
                 cache_hit_token_cost: float = 1.0, load_cache_s: float = 0.25, fair_share: bool = True,
                 clock: Callable[[], float] = time.time) -> None:
        self.redis = redis
        # Hold a backed-up lane's jobs per tenant and priority, for the workers to release in fair
        # turns (sluice/fair_share.py); off, every job joins the stream in arrival order.
        self.fair_share = fair_share
        self.broker = broker
        self.max_answered_jobs = max_answered_jobs
        self.cache_hit_token_cost = cache_hit_token_cost
        self.load_cache_s = load_cache_s
        self.clock = clock
        self._loads: dict[tuple[str, str], Load] = {}
        # The read under way per version, and the time it began.
        self._reading: dict[tuple[str, str], tuple[asyncio.Task[Load], float]] = {}
        self._admitted: Counter[tuple[str, str]] = Counter()
        self._unwritten: Counter[tuple[str, str]] = Counter()

    async def queue(self, key: KeyInfo, version: VersionInfo, records: Sequence[JobRecord], *,
                    idempotency: IdempotencyClaim | None = None) -> None:
        """Queue one submission's jobs (one lane of `version`), or raise TooManyRequests.

        Jobs answered from the response cache (`cache_hit`) are written with the others but cost
        no worker time: they are never shed, and a submission of hits alone never waits for a load
        read. They still spend rate tokens and must fit under the tenant's quota and its bound on
        stored answers (`sluice.wire.quota`)."""
        lane, count = records[0].lane, sum(1 for record in records if not record.cache_hit)
        if count:
            await self.shed(version, lane=lane, count=count, priority=records[0].priority)
        refusal: Refusal | None = None
        queued = False
        try:
            window = version.max_batch_size if self.fair_share else 0
            refusal = await self.broker.enqueue(records, idempotency=idempotency, window=window, limits=TenantLimits(
                tenant=key.tenant, rate_per_s=key.rate_limit_per_s, burst=key.rate_burst,
                max_queued=key.max_queued, max_answered=self.max_answered_jobs,
                hit_cost=self.cache_hit_token_cost))
            queued = refusal is None
        finally:
            self.written(version, lane=lane, count=count, queued=queued)
        if refusal is not None:
            raise _refused(key, refusal, max_answered=self.max_answered_jobs)

    async def shed(self, version: VersionInfo, *, lane: str, count: int, priority: int = DEFAULT_PRIORITY) -> None:
        """Raise TooManyRequests if `count` more jobs on `lane` would wait past their share of the
        version's budget (`SHED_AT`: the lowest priority is refused first); otherwise count them as
        admitted until `written` says what became of them."""
        if lane == "online":
            await self._shed(version, count, SHED_AT[priority])

    def written(self, version: VersionInfo, *, lane: str, count: int, queued: bool = True) -> None:
        """The jobs `shed` admitted are in the stream, or (`queued` False) never will be."""
        if lane == "online":
            self._unwritten[(version.model, version.version)] -= count
            if not queued:
                self._admitted[(version.model, version.version)] -= count

    async def load(self, model: str, version: str, *, newer_than: float | None = None) -> Load:
        """The version's load, read at most every `load_cache_s`. Submissions that find it stale
        while a read is under way wait for that read: each starting its own, a burst made one
        backlog read per request instead of one per interval. With `newer_than`, only a read that
        began at or after that time will do (one under way that began earlier is waited for, and
        then another is read, shared by all who wait for it)."""
        key = (model, version)
        while True:
            now = self.clock()
            cached = self._loads.get(key)
            if (cached is not None and now - cached.read_at < self.load_cache_s
                    and (newer_than is None or cached.read_at >= newer_than)):
                return cached
            under_way = self._reading.get(key)
            if under_way is not None and under_way[0].done():
                # Finished, its `_read_done` not yet run: awaiting a finished task never yields,
                # so waiting on it again would spin here without letting that callback run.
                under_way = None
            if under_way is None:
                # The counts as the read begins, taken before the task first runs: what is admitted
                # from here on may be missing from the backlog it reads.
                reading = asyncio.create_task(
                    self._read(model, version, now, mark=self._admitted[key], unwritten=self._unwritten[key]))
                self._reading[key] = (reading, now)
                reading.add_done_callback(partial(self._read_done, key))
                # Shielded: a request that goes away must not cancel the read the others wait for.
                return await asyncio.shield(reading)
            reading, began = under_way
            if newer_than is None or began >= newer_than:
                return await asyncio.shield(reading)
            await asyncio.shield(reading)

    def _read_done(self, key: tuple[str, str], reading: asyncio.Task[Load]) -> None:
        if self._reading.get(key, (None, 0.0))[0] is reading:
            del self._reading[key]
        if not reading.cancelled():
            reading.exception()  # retrieved here: its waiters may all have gone

    async def _read(self, model: str, version: str, now: float, *, mark: int, unwritten: int) -> Load:
        # One after the other, on one pooled connection: read concurrently, a second connection
        # left stale by a Redis restart turns the first submission after it into a 503.
        backlog = await self._backlog(model, version)
        beats = await heartbeats.live_heartbeats(self.redis, model, version, now=now)
        load = Load(backlog=backlog, service_rate=sum(beat.items_per_s for beat in beats),
                    live_workers=len(beats), read_at=now, admitted_mark=mark, unwritten=unwritten,
                    backlog_rate=sum(beat.backlog_items_per_s or beat.items_per_s for beat in beats),
                    held_online=sum(beat.held_online for beat in beats),
                    held_bulk=sum(beat.held_bulk for beat in beats))
        self._loads[(model, version)] = load
        return load

    async def _backlog(self, model: str, version: str) -> int:
        """The online lane's jobs in its stream and held (`keys.held_index`), in one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.xlen(keys.stream(model, version, "online"))
        pipe.hget(keys.held_index(model, version, "online"), "*")
        with translate_redis_errors():
            in_stream, held = await pipe.execute()
        return int(in_stream) + int(held or 0)

    def _backlog_with(self, key: tuple[str, str], load: Load, count: int) -> int:
        """The backlog `count` more jobs would join: the one read, this replica's admissions it
        may not show, and the jobs themselves."""
        return load.backlog + load.unwritten + self._admitted[key] - load.admitted_mark + count

    def _predicted(self, key: tuple[str, str], load: Load, count: int) -> float:
        if load.service_rate <= 0:
            return 0.0
        return self._backlog_with(key, load, count) / load.service_rate

    def _wait(self, key: tuple[str, str], load: Load, count: int, budget_s: float) -> float | None:
        return shed_retry_after(backlog=self._backlog_with(key, load, count), service_rate=load.service_rate,
                                budget_s=budget_s)

    async def _shed(self, version: VersionInfo, count: int, share: float) -> None:
        key = (version.model, version.version)
        budget_s = share * version.latency_budget_ms / 1000.0
        arrived = self.clock()
        load = await self.load(*key)
        wait = self._wait(key, load, count, budget_s)
        if wait is None and load.read_at < arrived and self._predicted(key, load, count) > FRESH_ABOVE * budget_s:
            # Near the budget, other replicas' admissions since the cached read matter: admit only
            # on a backlog read that began after this submission arrived (FRESH_ABOVE).
            load = await self.load(*key, newer_than=arrived)
            wait = self._wait(key, load, count, budget_s)
        # No await from here to the count: concurrent requests that read the same snapshot each
        # see the others' admissions, so a burst cannot slip in on one stale backlog.
        if wait is None:
            self._admitted[key] += count
            self._unwritten[key] += count
            return
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


def _refused(key: KeyInfo, refusal: Refusal, *, max_answered: int) -> TooManyRequests:
    if refusal.reason == "quota":
        return TooManyRequests(f"tenant '{key.tenant}' has {refusal.queued} queued jobs; its quota is {key.max_queued} "
                               "(jobs answered from the response cache count too)", headers={"Retry-After": "5"})
    if refusal.reason == "stored":
        bound = f"tenant '{key.tenant}' may store at most {max_answered} jobs answered from the response cache"
        if refusal.wait_s < 0:
            # Like a bulk larger than the quota: no wait helps, but every 429 names one.
            return StoredJobsLimit(f"{bound}; this submission alone has more: submit fewer inputs at once",
                                   headers={"Retry-After": "5"})
        return StoredJobsLimit(f"{bound} until their records expire",
                               headers={"Retry-After": str(max(1, math.ceil(refusal.wait_s)))})
    return TooManyRequests(f"tenant '{key.tenant}' is over its rate limit of {key.rate_limit_per_s:g} jobs/s",
                           headers={"Retry-After": str(max(1, math.ceil(refusal.wait_s)))})
