"""Durable accept (`SLUICE_DURABLE_ACCEPT`): a job is answered 202 only once Redis has fsynced it.

Redis answers a write once it is in memory and, with `appendfsync everysec` (what `sluice up`
ships), in its append-only file at most about a second later: a crash of the host in that second
loses jobs already answered 202. In durable mode the enqueue script (records, entries, quota,
the Idempotency-Key's completion) is followed, in the same round trip, by `WAITAOF 1 0 timeout`,
which returns once the local AOF is fsynced up to this connection's last write, and so up to
every write before it. Redis fsyncs at once for a waiting client: the wait is one fsync, not the
rest of the second.

The surprise: WAITAOF exists from Redis 7.2 (and in Valkey), needs `appendonly yes`, and on
`appendfsync no` confirms a write that only reached the page cache. Durable mode therefore
refuses, at start-up, a store that cannot keep the promise (`require_durable_store`), and every
submission checks the reply, so a store swapped underneath never turns into a silent downgrade.
"""

from __future__ import annotations

import logging
from typing import Any

import redis.asyncio as aioredis
from redis import exceptions as redis_errors
from redis.asyncio.cluster import ClusterPipeline

from sluice.errors import BrokerError, BrokerUnavailable
from sluice.wire.connections import translate_redis_errors

log = logging.getLogger(__name__)


class DurabilityUnsupported(BrokerError):
    """The store cannot confirm an fsync: durable accept cannot be promised on it."""


def wait_fsynced(pipe: Any, timeout_ms: int, *, near: str) -> None:
    """Add the wait for the local AOF fsync of everything before it to a pipeline, as its last
    command. WAITAOF names no key: on a cluster it is sent to the node that holds `near` (a key
    the pipeline wrote), so that it runs on the connection that wrote it."""
    if isinstance(pipe, ClusterPipeline):
        node = pipe.cluster_client.get_node_from_key(near)
        pipe.execute_command("WAITAOF", 1, 0, timeout_ms, target_nodes=node)
    else:
        pipe.execute_command("WAITAOF", 1, 0, timeout_ms)


def fsynced(reply: object) -> bool:
    """Whether WAITAOF's reply confirms the local fsync; an error reply (no AOF, an old server) does not."""
    if isinstance(reply, (list, tuple)) and reply:
        try:
            return int(reply[0]) >= 1
        except (TypeError, ValueError):
            return False
    return False


async def require_durable_store(client: aioredis.Redis, *, timeout_ms: int) -> None:
    """Raise DurabilityUnsupported unless the store confirms fsyncs of its append-only file.

    A store that cannot be reached now is let through with a warning: each submission still
    checks its own WAITAOF reply and answers 503 rather than an unconfirmed 202.
    """
    try:
        with translate_redis_errors():
            try:
                reply = await client.execute_command("WAITAOF", 1, 0, timeout_ms)  # type: ignore[no-untyped-call]
            except redis_errors.ResponseError as exc:
                raise DurabilityUnsupported(
                    "SLUICE_DURABLE_ACCEPT needs a store that confirms fsyncs (WAITAOF: Redis >= 7.2 or "
                    f"Valkey, with appendonly yes); this one answered: {exc}"
                ) from exc
            # A cluster client asks every node, and answers each node's reply.
            replies = list(reply.values()) if isinstance(reply, dict) else [reply]
            if not all(fsynced(each) for each in replies):
                raise DurabilityUnsupported(f"SLUICE_DURABLE_ACCEPT: the store did not confirm an fsync ({reply!r})")
            try:
                policy = await client.config_get("appendfsync")
            except redis_errors.ResponseError:
                # CONFIG is often disabled on managed services: WAITAOF's answer is all there is.
                return
    except BrokerUnavailable as exc:
        log.warning("durable accept: the store could not be checked now (%s); each submission will be", exc)
        return
    if str(policy.get("appendfsync", "")).lower() == "no":
        raise DurabilityUnsupported(
            "SLUICE_DURABLE_ACCEPT needs appendfsync everysec or always: with 'no' Redis confirms "
            "writes that only reached the page cache"
        )
