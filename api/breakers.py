"""Circuit breakers of every servable version, fed from Redis once a second.

Each API replica keeps its own breakers but feeds them the same shared facts (live workers from
the heartbeat set, recent outcomes from the version's sample stream), so replicas agree within
a refresh. The decision logic is `sluice.breaker.CircuitBreaker`, pure and tested on its own.

A submission reads `blocked` to route, then the version it was routed to takes the probe slot
(`take_probe`) with no await in between, so concurrent submissions cannot share one slot, and
jobs that went elsewhere never spend it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from api.caches import RoutingCache
from sluice.breaker import BreakerState, CircuitBreaker, Health
from sluice.errors import BrokerError
from sluice.metrics import BREAKER_OPEN
from sluice.versions import PRIMARY_STATES
from sluice.vocabulary import ZeroState
from sluice.wire import heartbeats, keys, samples
from sluice.wire.connections import translate_redis_errors

log = logging.getLogger(__name__)

RECENT_OUTCOMES = 200


@dataclass(frozen=True, slots=True)
class Probe:
    """A half-open version's probe slot, held by the job being queued to it."""

    model: str
    version: str
    taken_at: float


class BreakerBoard:
    def __init__(
        self,
        *,
        redis: aioredis.Redis,
        routing: RoutingCache,
        make_breaker: Callable[[], CircuitBreaker],
        refresh_s: float = 1.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.redis = redis
        self.routing = routing
        self.make_breaker = make_breaker
        self.refresh_s = refresh_s
        self.clock = clock
        self._breakers: dict[tuple[str, str], CircuitBreaker] = {}

    def blocked(self, model: str) -> frozenset[str]:
        """Versions of `model` that may not take a job now (open, or half-open between probes)."""
        now = self.clock()
        return frozenset(
            version for (name, version), breaker in self._breakers.items()
            if name == model and not breaker.admits(now)
        )

    def take_probe(self, model: str, version: str) -> Probe | None:
        """A job was routed to `version`: the probe, if its breaker is half-open (else None)."""
        breaker = self._breakers.get((model, version))
        now = self.clock()
        if breaker is None or not breaker.take_probe(now):
            return None
        return Probe(model=model, version=version, taken_at=now)

    def return_probe(self, probe: Probe) -> None:
        """The probe job was not queued (refused, or Redis failed): the next job may probe."""
        breaker = self._breakers.get((probe.model, probe.version))
        if breaker is not None:
            breaker.return_probe(probe.taken_at)

    def states(self) -> dict[str, dict[str, str]]:
        return {f"{m}/{v}": {"state": b.state.value, "reason": b.reason} for (m, v), b in self._breakers.items()}

    async def refresh(self) -> None:
        if not self.routing.loaded:
            return  # an API started while Postgres was down: nothing to judge until routing loads
        snapshot = self.routing.current()
        versions = [(m, v) for m, info in snapshot.models.items()
                    for v, row in info.versions.items() if row.state in PRIMARY_STATES]
        if not versions:
            self._breakers.clear()
            return
        now = self.clock()
        with translate_redis_errors():
            pipe = self.redis.pipeline(transaction=False)
            for model, version in versions:
                heartbeats.queue_live_count(pipe, model, version, now=now)
                samples.queue_recent(pipe, model, version, count=RECENT_OUTCOMES)
                pipe.hmget(keys.replicas(model, version), "desired", "zero")
            replies: list[Any] = await pipe.execute()
        alive = set(versions)
        for gone in [k for k in self._breakers if k not in alive]:
            del self._breakers[gone]
        for index, (model, version) in enumerate(versions):
            live, entries, (desired, zero) = replies[3 * index: 3 * index + 3]
            outcomes = [(sample.finished_at, sample.succeeded) for sample in samples.parse(entries)]
            breaker = self._breakers.setdefault((model, version), self.make_breaker())
            before = breaker.state
            after = breaker.observe(now, Health(live_workers=int(live), outcomes=outcomes,
                                                scaled_to_zero=desired == b"0" or zero == ZeroState.waking.encode()))
            if after is not before:
                log.warning("circuit breaker of %s/%s: %s -> %s (%s)", model, version, before.value,
                            after.value, breaker.reason or "recovered")
            BREAKER_OPEN.labels(model, version).set(0 if after is BreakerState.closed else 1)

    async def run_forever(self) -> None:
        failing: str | None = None
        while True:
            try:
                await self.refresh()
                failing = None
            except BrokerError:
                pass  # Redis is away: the breakers keep their state until it is back
            except Exception as exc:
                # Ending here would leave every breaker closed for the life of the process; logged
                # once per distinct failure, tried again next round.
                if repr(exc) != failing:
                    log.exception("circuit breakers not refreshed")
                failing = repr(exc)
            await asyncio.sleep(self.refresh_s)
