"""Redis connections: how a client is built, and how its errors become Sluice errors.

Connections are built by the caller and passed in; nothing here keeps a client of its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import redis.asyncio as aioredis
from redis import exceptions as redis_errors

from sluice.errors import BrokerError, BrokerUnavailable


@contextmanager
def translate_redis_errors(what: str = "Redis") -> Iterator[None]:
    """Map redis-py's exceptions onto the Sluice tree at the boundary."""
    try:
        yield
    except (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError) as exc:
        raise BrokerUnavailable(f"{what} is unreachable: {exc}") from exc
    except redis_errors.RedisError as exc:
        raise BrokerError(f"{what} failed: {exc}") from exc


def connect(url: str, *, max_connections: int = 64, socket_timeout_s: float = 5.0) -> aioredis.Redis:
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
    return aioredis.Redis.from_pool(pool)  # the client owns the pool: aclose() disconnects it
