"""Redis connections: how a client is built, and how its errors become Sluice errors.

Connections are built by the caller and passed in; nothing here keeps a client of its own.

A URL with the scheme `redis+cluster://` (or `rediss+cluster://`) names any node of a Redis
Cluster (or Valkey cluster): the client is then redis-py's cluster client, which learns the slot
map from that node and follows MOVED and ASK. It answers the same commands the code uses, each
script's keys in one slot (`sluice.wire.keys`), so it is handed out typed as the plain client.
`Settings.redis_cluster` (`SLUICE_REDIS_CLUSTER=1`) turns a plain URL into a cluster one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import redis
import redis.asyncio as aioredis
from redis import exceptions as redis_errors

from sluice.errors import BrokerError, BrokerUnavailable

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


@contextmanager
def translate_redis_errors(what: str = "Redis") -> Iterator[None]:
    """Map redis-py's exceptions onto the Sluice tree at the boundary."""
    try:
        yield
    except (redis_errors.ConnectionError, redis_errors.TimeoutError, redis_errors.ClusterDownError,
            redis_errors.RedisClusterException, OSError) as exc:
        # RedisClusterException (not a RedisError): the cluster client found no node to ask.
        raise BrokerUnavailable(f"{what} is unreachable: {exc}") from exc
    except redis_errors.RedisError as exc:
        raise BrokerError(f"{what} failed: {exc}") from exc


def reply_text(value: bytes | str | None) -> str:
    """A Redis reply as text, "" for none: whether a client decodes depends on how it was built."""
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


def cluster_url(url: str) -> str | None:
    """The plain URL of a cluster node when `url` has a cluster scheme; None for a single server."""
    scheme, sep, rest = url.partition("://")
    plain = CLUSTER_SCHEMES.get(scheme.lower())
    return f"{plain}{sep}{rest}" if plain and sep else None


def as_cluster_url(url: str) -> str:
    """`url` with the cluster scheme (what `SLUICE_REDIS_CLUSTER=1` does to a plain URL)."""
    if cluster_url(url) is not None:
        return url
    scheme, sep, rest = url.partition("://")
    return f"{scheme}+cluster{sep}{rest}"


def is_cluster(client: Any) -> bool:
    return isinstance(client, (aioredis.RedisCluster, redis.RedisCluster))


# Built once per redis-py connection class: some callers connect once per task or pass.
_HANDSHAKE_CHECKED: dict[type[Any], type[Any]] = {}


def _handshake_checked(connection_class: type[Any]) -> type[Any]:
    """`connection_class` whose handshake turns a malformed reply into a ConnectionError.

    redis-py opens every connection with HELLO and reads the reply as a map. A node that is
    restarting has been seen to answer it with something else, and redis-py then raises an
    AttributeError from inside the handshake, which no caller can tell from a bug of its own. As
    a ConnectionError it takes redis-py's reconnect path, and `translate_redis_errors` makes it
    BrokerUnavailable like any other moment without Redis.
    """
    async def on_connect_check_health(self: aioredis.Connection, check_health: bool = True) -> None:
        try:
            await connection_class.on_connect_check_health(self, check_health=check_health)
        except (AttributeError, TypeError) as exc:  # the caller disconnects on a RedisError
            raise redis_errors.ConnectionError(f"malformed reply to the connection handshake: {exc}") from exc

    return _subclass(connection_class, on_connect_check_health)


def _handshake_checked_sync(connection_class: type[Any]) -> type[Any]:
    """`_handshake_checked` for the synchronous client."""
    def on_connect_check_health(self: redis.Connection, check_health: bool = True) -> None:
        try:
            connection_class.on_connect_check_health(self, check_health=check_health)
        except (AttributeError, TypeError) as exc:
            raise redis_errors.ConnectionError(f"malformed reply to the connection handshake: {exc}") from exc

    return _subclass(connection_class, on_connect_check_health)


def _subclass(connection_class: type[Any], on_connect_check_health: Any) -> type[Any]:
    if connection_class not in _HANDSHAKE_CHECKED:
        _HANDSHAKE_CHECKED[connection_class] = type(f"HandshakeChecked{connection_class.__name__}", (connection_class,),
                                                    {"on_connect_check_health": on_connect_check_health})
    return _HANDSHAKE_CHECKED[connection_class]


def connect(url: str, *, max_connections: int = 64, socket_timeout_s: float = 5.0) -> aioredis.Redis:
    node_url = cluster_url(url)
    if node_url is not None:
        # No max_connections: a cluster node's pool raises at its limit instead of waiting, which
        # would turn a busy moment into 503s; its pool grows with the requests in flight instead.
        cluster = aioredis.RedisCluster.from_url(
            node_url, socket_timeout=socket_timeout_s, socket_connect_timeout=2.0, health_check_interval=15)
        # The cluster client takes no connection class of its own: each node it finds is built
        # from the nodes manager's kwargs, and the start-up nodes are built already.
        nodes = cluster.nodes_manager
        checked = _handshake_checked(nodes.connection_kwargs.get("connection_class", aioredis.Connection))
        nodes.connection_kwargs["connection_class"] = checked
        for node in nodes.startup_nodes.values():
            node.connection_class = checked
        return cast(aioredis.Redis, cluster)
    # A blocking pool makes a burst of requests wait for a free connection; the default pool
    # raises "Too many connections", which would turn a busy moment into 503s.
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=socket_timeout_s,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=2.0,
        health_check_interval=15,
        retry_on_timeout=False,
    )
    pool.connection_class = _handshake_checked(pool.connection_class)
    return aioredis.Redis.from_pool(pool)  # the client owns the pool: aclose() disconnects it


def connect_sync(url: str, *, socket_timeout_s: float | None = 5.0, **options: Any) -> redis.Redis:
    """The synchronous client of `url` (Celery tasks, the scheduler), a cluster client likewise."""
    node_url = cluster_url(url)
    if node_url is not None:
        plain_class = redis.SSLConnection if node_url.startswith("rediss:") else redis.Connection
        cluster = redis.RedisCluster.from_url(node_url, socket_timeout=socket_timeout_s, socket_connect_timeout=2.0,
                                              connection_class=_handshake_checked_sync(plain_class), **options)
        return cast(redis.Redis, cluster)
    client = redis.Redis.from_url(url, socket_timeout=socket_timeout_s, socket_connect_timeout=2.0, **options)
    pool = client.connection_pool
    pool.connection_class = _handshake_checked_sync(pool.connection_class)
    return client


def stop_if_cancelled(exc: BrokerError | None = None) -> None:
    """Raise CancelledError if the running task is being cancelled. redis-py can take the
    cancellation of a command in flight for a lost connection: it answers a connection error, or
    reconnects and sends the command again under its retry policy and answers that. A loop that
    goes on after either would run past its task's stop, and hold the event loop's shutdown for
    ever: each of a worker's loops asks after every Redis call."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError from exc
