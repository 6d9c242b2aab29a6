"""Folds the served mix that workers count in Redis into the registry's daily aggregates, and
exports each version's drift from the mix its batching was tuned on (`sluice_mix_drift`).

Workers add their counts to a hash of hours (sluice/wire/mix.py). Each flush writes, for every day
the hash still holds whole, that day's row per lane (replacing it: the hash has the day's running
total), forgets the hours older than `KEEP_HOURS`, and sets the drift over the last 24 hours. A day
whose first hours are already forgotten is not written again: it was written whole while they
were there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, date, datetime

import redis.asyncio as aioredis

from sluice.errors import SluiceError
from sluice.metrics import MIX_DRIFT
from sluice.mix import Mix
from sluice.registry import mix as mix_rows
from sluice.registry import tuning
from sluice.registry.store import Registry
from sluice.vocabulary import LANES
from sluice.wire import mix as wire_mix
from sluice.wire.connections import connect

log = logging.getLogger(__name__)

HOURS_PER_DAY = 24
_EPOCH = date(1970, 1, 1)


def day_of(hour: int) -> date:
    return datetime.fromtimestamp(hour * wire_mix.HOUR_S, tz=UTC).date()


def first_hour(day: date) -> int:
    return (day - _EPOCH).days * HOURS_PER_DAY


class MixAggregator:
    def __init__(self, *, registry: Registry, redis: aioredis.Redis, clock: Callable[[], float] = time.time) -> None:
        self.registry = registry
        self.redis = redis
        self.clock = clock

    async def flush(self) -> int:
        """Write the days every non-retired version's hash holds whole; answer the rows written."""
        now_hour = wire_mix.hour_of(self.clock())
        oldest_kept = now_hour - wire_mix.KEEP_HOURS
        with self.registry.session() as session:
            versions = tuning.served(session)
        written = 0
        for version in versions:
            hours = await wire_mix.read_hours(self.redis, version.model, version.version)
            days: dict[tuple[date, str], Mix] = {}
            for (hour, lane), mix in hours.items():
                key = (day_of(hour), lane)
                days[key] = days.get(key, Mix()) + mix
            whole = {key: mix for key, mix in days.items() if first_hour(key[0]) >= oldest_kept}
            if whole:
                with self.registry.session() as session:
                    for (day, lane), mix in sorted(whole.items()):
                        mix_rows.record_day(session, model=version.model, version=version.version, lane=lane,
                                            day=day, mix=mix)
                written += len(whole)
            self._export_drift(version, hours, now_hour=now_hour)
            await wire_mix.forget_before(self.redis, version.model, version.version, list(hours),
                                         before_hour=oldest_kept)
        return written

    @staticmethod
    def _export_drift(version: tuning.Tuning, hours: dict[tuple[int, str], Mix], *, now_hour: int) -> None:
        reference = version.tuned_mix
        found = wire_mix.lane_drift(hours, reference, now_hour=now_hour) if reference else {}
        for lane in LANES:
            if lane in found:
                MIX_DRIFT.labels(version.model, version.version, lane).set(found[lane])
            else:
                with contextlib.suppress(KeyError):
                    MIX_DRIFT.remove(version.model, version.version, lane)


def run_mix_aggregator(*, registry: Registry, redis_url: str, stopping: threading.Event,
                       every_s: float = 60.0) -> None:
    """Thread body for the scheduler process: fold the counts every `every_s`."""

    async def main() -> None:
        client = connect(redis_url, max_connections=2)
        aggregator = MixAggregator(registry=registry, redis=client)
        try:
            while not stopping.is_set():
                try:
                    await aggregator.flush()
                except SluiceError as exc:
                    log.warning("the served mix was not folded this time: %s", exc)
                await asyncio.to_thread(stopping.wait, every_s)
        finally:
            await client.aclose()

    asyncio.run(main())
