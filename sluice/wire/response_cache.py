"""The opt-in response cache of a version (`cache_ttl_s` > 0): an exact-match cache of outputs,
keyed on the version (`keys.cache`), the tenant and the canonical input.

The API looks a submission's inputs up in one MGET (`lookup`); a hit becomes a job answered at
once (`answered`): written `succeeded` with `cache_hit`, never given a stream entry, so no worker
sees it. A miss is queued as usual, carrying its cache key and the TTL its version had at
submission; the finish script (sluice/wire/lua/finish.lua) stores its output there if it succeeds,
in the step that makes it final. Failed jobs and shadow copies (which carry no key) never do.

The surprising parts: the tenant is part of the digest, so one tenant's traffic never answers
another's (nor tells it, by a fast answer, what the other asked); the version is part of the key,
so a new version starts empty and never serves an old one's output, and every key of its cache
is in its slot, beside the jobs whose outputs fill it. A submission that mixes hits and misses is
admitted as one (the misses take quota places) and written by one script
(sluice/wire/lua/queue.lua), so a refused submission leaves no answered job behind.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, cast

import orjson
import redis.asyncio as aioredis

from sluice.wire import keys
from sluice.wire.connections import translate_redis_errors
from sluice.wire.jobs import JobRecord, JobStatus

# The most a version may keep an output: its registration and PATCH refuse more.
MAX_TTL_S = 30 * 24 * 3600

def digest(tenant: str, canonical_input: Mapping[str, Any]) -> str:
    """The cache's name for one tenant's input: key order and spacing never make two entries."""
    text = json.dumps([tenant, canonical_input], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def cache_keys(model: str, version: str, tenant: str, inputs: Sequence[Mapping[str, Any]]) -> list[str]:
    return [keys.cache(model, version, digest(tenant, canonical)) for canonical in inputs]


async def lookup(redis: aioredis.Redis, names: Sequence[str]) -> list[bytes | None]:
    """The stored output (JSON) under each of `cache_keys`' names, None for a miss: one round trip."""
    with translate_redis_errors():
        # Bytes: the platform's clients never decode replies (`connections.connect`).
        return cast(list[bytes | None], await redis.mget(names))


def answered(record: JobRecord, output: bytes, *, at: float) -> JobRecord:
    """The job `record` would have been, answered from the cache at `at`: no queue wait (started
    when submitted), no model time (null, not 0: no model ran) and no batch."""
    return replace(record, status=JobStatus.succeeded, output=orjson.loads(output), cache_hit=True,
                   started_at=record.enqueued_at, finished_at=at, cache_key=None, cache_ttl_s=0, shadow=None)
