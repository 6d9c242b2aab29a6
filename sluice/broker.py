"""The job broker on Redis: connections, error translation and the submit/read/cancel verbs.

The API and the workers share this module so the wire contract (`keys`, `jobs`) has one
implementation. Connections are built by the caller and passed in.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import redis.asyncio as aioredis
from redis import exceptions as redis_errors

from sluice import keys
from sluice.errors import BrokerError, BrokerUnavailable, NotFound
from sluice.jobs import CANCEL_SCRIPT, JobRecord


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


def events_channel(redis: aioredis.Redis | Any) -> str:
    """The events channel of the database this client talks to (sync or asyncio client)."""
    return keys.events_channel(int(redis.connection_pool.connection_kwargs.get("db", 0)))


async def announce_routing(redis: aioredis.Redis, model: str) -> None:
    """Tell every API replica and the scheduler that a model's routing changed (the API and the
    rollout controller both call this); their periodic reload is the safety net."""
    with translate_redis_errors():
        await redis.publish(events_channel(redis), json.dumps({"type": "routing", "model": model},
                                                            separators=(",", ":")))


async def ensure_groups(redis: aioredis.Redis, model: str, version: str) -> None:
    """Create the consumer group on both lanes (and the streams) if missing."""
    for lane in keys.LANES:
        try:
            with translate_redis_errors():
                await redis.xgroup_create(keys.stream(model, version, lane), keys.GROUP, id="0", mkstream=True)
        except BrokerError as exc:
            if "BUSYGROUP" not in str(exc):
                raise


def queue_jobs(pipe: Any, records: Sequence[JobRecord], *, result_ttl_s: int) -> None:
    """Add the commands that queue `records` to a pipeline (the API's submit, a worker's shadow copy).

    The record goes first: a worker that reads the entry must always find the job.
    """
    for record in records:
        key = keys.job(record.id)
        pipe.hset(key, mapping=record.to_redis())
        pipe.expire(key, result_ttl_s)
    per_tenant: dict[str, int] = {}
    for record in records:
        per_tenant[record.tenant] = per_tenant.get(record.tenant, 0) + 1
    for tenant, count in per_tenant.items():
        pipe.incrby(keys.queued_count(tenant), count)
    for record in records:
        pipe.xadd(keys.stream(record.model, record.version, record.lane), record.stream_entry())  # type: ignore[arg-type]


class Broker:
    """Submit, read, cancel and announce jobs; one instance per process over a shared client."""

    def __init__(self, *, redis: aioredis.Redis, result_ttl_s: int) -> None:
        self.redis = redis
        self.result_ttl_s = result_ttl_s
        self._cancel = redis.register_script(CANCEL_SCRIPT)

    async def enqueue(self, records: Sequence[JobRecord]) -> None:
        """Write each job's record, then its stream entry, in one round trip."""
        with translate_redis_errors():
            pipe = self.redis.pipeline(transaction=False)
            queue_jobs(pipe, records, result_ttl_s=self.result_ttl_s)
            await pipe.execute()

    async def get(self, job_id: str) -> JobRecord | None:
        with translate_redis_errors():
            raw = await self.redis.hgetall(keys.job(job_id))
        return JobRecord.from_redis(raw) if raw else None

    async def get_for_tenant(self, job_id: str, tenant: str) -> JobRecord:
        """Another tenant's job answers exactly like a missing one: nothing leaks its existence."""
        record = await self.get(job_id) if job_id.startswith("job_") else None
        if record is None or record.tenant != tenant:
            raise NotFound(f"job '{job_id}' does not exist")
        return record

    async def cancel(self, job_id: str, tenant: str) -> str | None:
        """Cancel a queued job; answer None when done, else the state that prevents it."""
        with translate_redis_errors():
            outcome = await self._cancel(keys=[keys.job(job_id), keys.queued_count(tenant), keys.WEBHOOK_OUTBOX],
                                         args=[repr(time.time())])
        state = outcome.decode() if isinstance(outcome, bytes) else str(outcome)
        if state != "ok":
            return state
        await self.publish({"type": "job", "id": job_id, "status": "cancelled"})
        return None

    async def publish(self, event: dict[str, Any]) -> None:
        with translate_redis_errors():
            await self.redis.publish(events_channel(self.redis), json.dumps(event, separators=(",", ":")))

    async def ping(self) -> None:
        with translate_redis_errors():
            await self.redis.ping()
