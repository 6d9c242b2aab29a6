"""The queue's state per version on the API's `/metrics`, read from Redis at scrape time: one
scrape of any API replica shows every version's lag, pending entries, oldest entry and live
workers, whichever process (or none) is running for it."""

from __future__ import annotations

import redis.asyncio as aioredis

from sluice import keys
from sluice.connections import translate_redis_errors
from sluice.heartbeats import live_since
from sluice.metrics import LIVE_WORKERS, QUEUE_OLDEST_AGE, QUEUE_PENDING, STREAM_LAG
from sluice.routing import RoutingSnapshot
from sluice.versions import VersionState


async def refresh_queue_gauges(redis: aioredis.Redis, snapshot: RoutingSnapshot, *, now: float) -> None:
    """Set the gauges of every version that is not retired, in one round trip; a retired or removed
    version's series go away."""
    versions = [(model.name, info.version) for model in snapshot.models.values()
                for info in model.versions.values() if info.state != VersionState.retired]
    pipe = redis.pipeline(transaction=False)
    for model, version in versions:
        for lane in keys.LANES:
            stream = keys.stream(model, version, lane)
            pipe.xlen(stream)
            pipe.xpending(stream, keys.GROUP)
            pipe.xrange(stream, count=1)
        pipe.zcount(keys.live_workers(model, version), live_since(now), "+inf")
    with translate_redis_errors():
        # A stream no worker has read yet has no group: its XPENDING fails, and it has none pending.
        replies = iter(await pipe.execute(raise_on_error=False))
    for gauge in (STREAM_LAG, QUEUE_PENDING, QUEUE_OLDEST_AGE, LIVE_WORKERS):
        gauge.clear()
    for model, version in versions:
        for lane in keys.LANES:
            length, pending, first = next(replies), next(replies), next(replies)
            STREAM_LAG.labels(model, version, lane).set(_number(length))
            QUEUE_PENDING.labels(model, version, lane).set(
                int(pending["pending"]) if isinstance(pending, dict) else 0)
            QUEUE_OLDEST_AGE.labels(model, version, lane).set(_oldest_age(first, now))
        LIVE_WORKERS.labels(model, version).set(_number(next(replies)))


def _number(reply: object) -> float:
    return float(reply) if isinstance(reply, int | float) else 0.0


def _oldest_age(reply: object, now: float) -> float:
    """Seconds since the first entry was added (its id is the server's milliseconds), 0 when none."""
    if not isinstance(reply, list) or not reply:
        return 0.0
    entry_id = reply[0][0]
    millis = int((entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)).split("-", 1)[0])
    return max(0.0, now - millis / 1000)
