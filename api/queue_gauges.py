"""The queue's state per version, read from Redis when asked: on the API's `/metrics` at scrape
time (one scrape of any API replica shows every version's lag, pending entries, oldest entry and
live workers, whichever process, or none, is running for it), and as JSON for the dashboard
(`GET /v1/models/{model}/queue`). One read serves both, in one round trip."""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from sluice.metrics import LIVE_WORKERS, QUEUE_OLDEST_AGE, QUEUE_PENDING, STREAM_LAG
from sluice.routing import RoutingSnapshot
from sluice.versions import VersionState
from sluice.vocabulary import LANES, Lane
from sluice.wire import keys
from sluice.wire.connections import translate_redis_errors
from sluice.wire.heartbeats import live_since


@dataclass(frozen=True, slots=True)
class LaneQueue:
    # Queued and in flight: the stream's entries (one leaves once its outcome is stored) and the
    # jobs held beside it (queue.lua).
    lag: int
    pending: int  # delivered to a worker and not acknowledged
    oldest_age_s: float  # since the first entry was added; 0 when the stream is empty


@dataclass(frozen=True, slots=True)
class VersionQueue:
    lanes: dict[Lane, LaneQueue]
    live_workers: int


def serving_versions(snapshot: RoutingSnapshot, model: str | None = None) -> list[tuple[str, str]]:
    """(model, version) of every version that is not retired, of one model or of all."""
    models = [snapshot.model(model)] if model is not None else list(snapshot.models.values())
    return [(info.name, version.version) for info in models
            for version in info.versions.values() if version.state != VersionState.retired]


async def read_queues(redis: aioredis.Redis, versions: list[tuple[str, str]], *,
                      now: float) -> dict[tuple[str, str], VersionQueue]:
    """Every listed version's queue, in one round trip."""
    pipe = redis.pipeline(transaction=False)
    for model, version in versions:
        for lane in LANES:
            stream = keys.stream(model, version, lane)
            pipe.xlen(stream)
            pipe.xpending(stream, keys.GROUP)
            pipe.xrange(stream, count=1)
            pipe.hget(keys.held_index(model, version, lane), "*")
        pipe.zcount(keys.live_workers(model, version), live_since(now), "+inf")
    with translate_redis_errors():
        # A stream no worker has read yet has no group: its XPENDING fails, and it has none pending.
        replies = iter(await pipe.execute(raise_on_error=False))
    queues = {}
    for model, version in versions:
        lanes = {}
        for lane in LANES:
            length, pending, first, held = next(replies), next(replies), next(replies), next(replies)
            lanes[lane] = LaneQueue(lag=int(_number(length)) + int(_number(held)),
                                    pending=int(pending["pending"]) if isinstance(pending, dict) else 0,
                                    oldest_age_s=_oldest_age(first, now))
        queues[(model, version)] = VersionQueue(lanes=lanes, live_workers=int(_number(next(replies))))
    return queues


async def refresh_queue_gauges(redis: aioredis.Redis, snapshot: RoutingSnapshot, *, now: float) -> None:
    """Set the gauges of every version that is not retired, in one round trip; a retired or removed
    version's series go away."""
    queues = await read_queues(redis, serving_versions(snapshot), now=now)
    for gauge in (STREAM_LAG, QUEUE_PENDING, QUEUE_OLDEST_AGE, LIVE_WORKERS):
        gauge.clear()
    for (model, version), queue in queues.items():
        for lane, state in queue.lanes.items():
            STREAM_LAG.labels(model, version, lane).set(state.lag)
            QUEUE_PENDING.labels(model, version, lane).set(state.pending)
            QUEUE_OLDEST_AGE.labels(model, version, lane).set(state.oldest_age_s)
        LIVE_WORKERS.labels(model, version).set(queue.live_workers)


def _number(reply: object) -> float:
    """A number Redis answered (an integer, or a hash field's text); 0 for nothing or an error."""
    if isinstance(reply, bytes | str):
        return float(reply)
    return float(reply) if isinstance(reply, int | float) else 0.0


def _oldest_age(reply: object, now: float) -> float:
    """Seconds since the first entry was added (its id is the server's milliseconds), 0 when none."""
    if not isinstance(reply, list) or not reply:
        return 0.0
    entry_id = reply[0][0]
    millis = int((entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)).split("-", 1)[0])
    return max(0.0, now - millis / 1000)
