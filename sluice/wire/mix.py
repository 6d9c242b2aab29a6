"""A version's served mix and its recorded forward passes, as workers flush them to Redis.

`keys.mix` is a hash of counts: field `{hour}:{lane}:{bucket}` (whole UTC hours since the epoch, a
lane, a `sluice.mix` bucket label), incremented by every worker of the version (HINCRBY), so the
counts of many workers add up without coordination. `keys.passes` is a capped stream of the last
`PASSES_MAXLEN` forward passes (jobs, longest cost, model seconds): what the tuning job fits the
version's cost model to. Neither holds a tenant, an input or an output.

A worker counts in memory (`Tally`) and flushes with its heartbeat, one pipeline every few
seconds, not a round trip per batch. The scheduler's mix aggregator (scheduler/mix.py) reads the
hours, folds them into the registry's daily aggregates and forgets hours older than `KEEP_HOURS`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis

from sluice.mix import BUCKET_LABELS, Mix, bucket_of, drift
from sluice.vocabulary import LANES, Lane
from sluice.wire import keys
from sluice.wire.connections import translate_redis_errors

HOUR_S = 3600
# Two days: the open day and the one before it, whatever the hour the aggregator last ran.
KEEP_HOURS = 48
PASSES_MAXLEN = 2000
# The recent window the drift gauge, the version resource and the tuning job read the mix over.
RECENT_HOURS = 24


def hour_of(at: float) -> int:
    return int(at // HOUR_S)


@dataclass(frozen=True, slots=True)
class Pass:
    """One forward pass: how many jobs, the longest one's cost (what the batch was padded to for a
    padding handler), and the model seconds it took."""

    size: int
    longest: int
    seconds: float

    def to_fields(self) -> dict[str, str]:
        return {"n": str(self.size), "c": str(self.longest), "s": repr(self.seconds)}

    @classmethod
    def from_fields(cls, fields: Mapping[bytes, bytes]) -> Pass:
        return cls(size=int(fields[b"n"]), longest=int(fields[b"c"]), seconds=float(fields[b"s"]))


class Tally:
    """What one worker counted since its last flush."""

    def __init__(self) -> None:
        self._counts: Counter[tuple[int, Lane, int]] = Counter()
        self._passes: list[Pass] = []

    def served(self, *, at: float, lane: Lane, costs: Iterable[int]) -> None:
        hour = hour_of(at)
        for cost in costs:
            self._counts[(hour, lane, bucket_of(cost))] += 1

    def passed(self, recorded: Pass) -> None:
        # Bounded between flushes as the stream is: a worker cut off from Redis keeps the newest.
        self._passes.append(recorded)
        if len(self._passes) > PASSES_MAXLEN:
            del self._passes[: len(self._passes) - PASSES_MAXLEN]

    async def flush(self, redis: aioredis.Redis, model: str, version: str) -> None:
        """Add the counts and passes to the version's keys; on a Redis error they are kept for the
        next flush (the error is raised)."""
        counts, recorded = self._counts, self._passes
        if not counts and not recorded:
            return
        self._counts, self._passes = Counter(), []
        try:
            with translate_redis_errors():
                pipe = redis.pipeline(transaction=False)
                for (hour, lane, bucket), count in counts.items():
                    pipe.hincrby(keys.mix(model, version), f"{hour}:{lane}:{BUCKET_LABELS[bucket]}", count)
                for one in recorded:
                    pipe.xadd(keys.passes(model, version), one.to_fields(),  # type: ignore[arg-type]
                              maxlen=PASSES_MAXLEN, approximate=True)
                # A version no worker serves any more leaves nothing behind once its hours are old.
                for key in (keys.mix(model, version), keys.passes(model, version)):
                    pipe.expire(key, KEEP_HOURS * HOUR_S)
                await pipe.execute()
        except BaseException:
            self._counts.update(counts)
            self._passes[:0] = recorded
            raise


async def read_hours(redis: aioredis.Redis, model: str, version: str) -> dict[tuple[int, str], Mix]:
    """The version's counted hours: (hour, lane) -> its mix."""
    with translate_redis_errors():
        raw: dict[bytes, bytes] = await redis.hgetall(keys.mix(model, version))  # type: ignore[assignment,misc]
    by_hour: dict[tuple[int, str], dict[str, int]] = {}
    for field, value in raw.items():
        hour, lane, label = field.decode().split(":")
        by_hour.setdefault((int(hour), lane), {})[label] = int(value)
    return {key: Mix.from_mapping(counts) for key, counts in by_hour.items()}


def recent_mix(hours: Mapping[tuple[int, str], Mix], *, now_hour: int, lane: str | None = None) -> Mix:
    """The mix of the last `RECENT_HOURS` (the open hour included), of one lane or of all."""
    total = Mix()
    for (hour, hour_lane), mix in hours.items():
        if hour > now_hour - RECENT_HOURS and (lane is None or hour_lane == lane):
            total = total + mix
    return total


def lane_drift(hours: Mapping[tuple[int, str], Mix], reference: Mix, *, now_hour: int) -> dict[str, float]:
    """Each lane's drift (`sluice.mix.drift`) from `reference` over the recent window; a lane that
    served nothing in it is left out."""
    found: dict[str, float] = {}
    for lane in LANES:
        value = drift(recent_mix(hours, now_hour=now_hour, lane=lane), reference)
        if value is not None:
            found[lane] = value
    return found


async def forget_before(redis: aioredis.Redis, model: str, version: str, hours: Sequence[tuple[int, str]],
                        *, before_hour: int) -> None:
    """Delete the fields of the listed hours that are older than `before_hour`."""
    fields = [f"{hour}:{lane}:{label}" for hour, lane in hours if hour < before_hour for label in BUCKET_LABELS]
    if fields:
        with translate_redis_errors():
            await redis.hdel(keys.mix(model, version), *fields)  # type: ignore[misc]


async def read_passes(redis: aioredis.Redis, model: str, version: str, *, count: int = PASSES_MAXLEN) -> list[Pass]:
    """The version's `count` most recent passes, newest first."""
    with translate_redis_errors():
        entries: list[tuple[bytes, dict[bytes, bytes]]] = await redis.xrevrange(  # type: ignore[assignment]
            keys.passes(model, version), count=count)
    return [Pass.from_fields(fields) for _, fields in entries]
