"""The events channels: what crosses them, and their one codec.

Control events (`RoutingChanged`, `KeyRevoked`) go to `sluice:events`, which every API replica and
the scheduler subscribe to: each of them must reload routing or forget a revoked key. A job's
changes go to the job's own sharded channel (SPUBLISH, `keys.job_events_channel`), which an API
replica subscribes to only while one of its long-polls or event streams waits on that job
(`api/job_subscriptions.py`), so a replica never reads the events of jobs nobody there awaits.
Delivery is best effort (pub/sub keeps nothing): every listener also refreshes on a timer, and a
listener that reconnects treats the gap as a `Resync`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

import redis.asyncio as aioredis

from sluice.wire import keys
from sluice.wire.connections import is_cluster, translate_redis_errors


@dataclass(frozen=True, slots=True)
class JobChanged:
    """A job's status changed (running, or a final state)."""

    id: str
    status: str


@dataclass(frozen=True, slots=True)
class RoutingChanged:
    """A model's routing (weights, pins, version states) changed in the registry."""

    model: str


@dataclass(frozen=True, slots=True)
class KeyRevoked:
    key_hash: str


@dataclass(frozen=True, slots=True)
class Resync:
    """Never sent: a listener makes it after a gap in its subscription, when it may have missed
    anything."""


# What crosses the channels; a listener may also see a Resync it made itself.
Sent = JobChanged | RoutingChanged | KeyRevoked
Event = Sent | Resync

_TYPES: dict[str, type[Sent]] = {
    "job": JobChanged, "routing": RoutingChanged, "key.revoked": KeyRevoked,
}
_NAMES = {cls: name for name, cls in _TYPES.items()}


def encode(event: Sent) -> str:
    # Its Lua twin for a JobChanged, sluice/wire/lua/lib/job_changed.lua, announces a job's state in
    # the same atomic step as the script that writes it.
    return json.dumps({"type": _NAMES[type(event)], **asdict(event)}, separators=(",", ":"))


def parse(data: bytes | str) -> Event | None:
    """The event in a message, or None for anything this version does not know or cannot read."""
    try:
        message = json.loads(data)
        cls = _TYPES[message["type"]]
        return cls(**{field.name: str(message[field.name]) for field in fields(cls)})
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def _db(redis: aioredis.Redis | Any) -> int:
    pool = getattr(redis, "connection_pool", None)
    return 0 if pool is None else int(pool.connection_kwargs.get("db", 0))


def channel(redis: aioredis.Redis | Any) -> str:
    """The broadcast events channel of the database this client talks to (sync or asyncio client;
    a cluster has database 0 only)."""
    return keys.events_channel(_db(redis))


def job_channel(redis: aioredis.Redis | Any, job_id: str) -> str:
    """The sharded channel that carries one job's changes."""
    return keys.job_events_channel(_db(redis), job_id)


async def subscribe(redis: aioredis.Redis) -> Any:
    """A pub/sub connection subscribed to the broadcast events channel (the caller closes it).

    On a cluster, PUBLISH reaches every node's subscribers, so one node suffices: the one that
    owns the channel name's slot, which the client can name only once it knows the slot map.
    """
    if is_cluster(redis):
        await redis.initialize()  # type: ignore[attr-defined]
    pubsub = redis.pubsub(ignore_subscribe_messages=True)
    try:
        await pubsub.subscribe(channel(redis))
    except BaseException:
        # The caller cannot close what it never got, and the pub/sub may hold a pooled connection.
        await pubsub.aclose()  # type: ignore[no-untyped-call]
        raise
    return pubsub


async def publish(redis: aioredis.Redis, event: Sent) -> None:
    with translate_redis_errors():
        if isinstance(event, JobChanged):
            await redis.spublish(job_channel(redis, event.id), encode(event))
        else:
            await redis.publish(channel(redis), encode(event))


async def announce_routing(redis: aioredis.Redis, model: str) -> None:
    """Tell every API replica and the scheduler that a model's routing changed (the API, the CLI and
    the rollout controller all call this); their periodic reload is the safety net."""
    await publish(redis, RoutingChanged(model=model))
