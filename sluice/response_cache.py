"""The opt-in response cache of a version (`cache_ttl_s` > 0): an exact-match cache of outputs,
keyed on the version (`keys.cache`), the tenant and the canonical input.

The API looks a submission's inputs up in one MGET (`lookup`); a hit becomes a job answered at
once (`answered`): written `succeeded` with `cache_hit`, never given a stream entry, so no worker
sees it. A miss is queued as usual, carrying its cache key and the TTL its version had at
submission; the finish script (`streams.FINISH_SCRIPT`) stores its output there if it succeeds,
in the step that makes it final. Failed jobs and shadow copies (which carry no key) never do.

The surprising parts: the tenant is part of the digest, so one tenant's traffic never answers
another's (nor tells it, by a fast answer, what the other asked); the version is part of the key,
so a new version starts empty and never serves an old one's output. A submission that mixes hits
and misses is one script call (`SUBMIT_SCRIPT`): the misses are queued by the enqueue script and
the hits written only if that passes, so a refused submission leaves no answered job behind.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from itertools import chain
from typing import Any, cast

import orjson
import redis.asyncio as aioredis

from sluice import keys
from sluice.connections import translate_redis_errors
from sluice.idempotency import IdempotencyClaim
from sluice.jobs import JobRecord, JobStatus
from sluice.outbox import QUEUE_WEBHOOK
from sluice.quota import TenantLimits
from sluice.streams import ENQUEUE_SCRIPT, enqueue_call

# The most a version may keep an output: its registration and PATCH refuse more.
MAX_TTL_S = 30 * 24 * 3600

# KEYS: the webhook outbox; the Idempotency-Key when this script completes it (every job a hit);
# ENQUEUE_SCRIPT's KEYS (some jobs missed); then per hit its job hash. ARGV: result_ttl_s, the
# number of ENQUEUE_SCRIPT's KEYS and of its ARGV (both 0 when every job hit), the key's
# in-progress marker or '', its completed record, idempotency_ttl_s, ENQUEUE_SCRIPT's ARGV, then
# per hit its record (the number of fields, then the fields).
# The misses go first, through ENQUEUE_SCRIPT run as a function of its own KEYS and ARGV: a refusal
# of theirs ({'lost'}, {'quota', n}, {'rate', s}) is answered with no hit written. Then each hit is
# written final with its webhook queued, as the other scripts that make a job final do. No
# job-final event: nobody can be waiting on a job whose id has not been answered yet.
SUBMIT_SCRIPT = QUEUE_WEBHOOK + "local function enqueue(KEYS, ARGV)\n" + ENQUEUE_SCRIPT + "\nend\n" + """
local function slice(list, first, count)
  local part = {}
  for i = first, first + count - 1 do part[#part + 1] = list[i] end
  return part
end
local ttl, queued_keys, queued_args, marker = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local k, a = 2, 7
if marker ~= '' then
  if redis.call('GET', KEYS[2]) ~= marker then return {'lost'} end
  k = 3
end
if queued_keys > 0 then
  local verdict = enqueue(slice(KEYS, k, queued_keys), slice(ARGV, a, queued_args))
  if verdict[1] ~= 'ok' then return verdict end
end
k, a = k + queued_keys, a + queued_args
for h = k, #KEYS do
  local n = tonumber(ARGV[a])
  redis.call('HSET', KEYS[h], unpack(ARGV, a + 1, a + 2 * n))
  redis.call('EXPIRE', KEYS[h], ttl)
  queue_webhook(KEYS[h], KEYS[1])
  a = a + 1 + 2 * n
end
if marker ~= '' then redis.call('SET', KEYS[2], ARGV[5], 'EX', ARGV[6]) end
return {'ok'}
"""


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


def submit_call(records: Sequence[JobRecord], *, limits: TenantLimits, now: float, result_ttl_s: int,
                idempotency: IdempotencyClaim | None, idempotency_ttl_s: int) -> tuple[list[str], list[str]]:
    """KEYS and ARGV of SUBMIT_SCRIPT for one submission's jobs in input order, the hits
    (`cache_hit`) among them; the Idempotency-Key replays them all, in that order."""
    queued = [record for record in records if not record.cache_hit]
    hits = [record for record in records if record.cache_hit]
    script_keys, args = [keys.WEBHOOK_OUTBOX], [str(result_ttl_s)]
    enqueue_keys: list[str] = []
    enqueue_args: list[str] = []
    if queued:
        enqueue_keys, enqueue_args = enqueue_call(
            queued, limits=limits, now=now, result_ttl_s=result_ttl_s, idempotency=idempotency,
            idempotency_ttl_s=idempotency_ttl_s, answers=[record.id for record in records])
    args += [str(len(enqueue_keys)), str(len(enqueue_args))]
    if idempotency is not None and not queued:
        script_keys.append(idempotency.redis_key)
        args += [idempotency.marker, idempotency.completed([record.id for record in records]),
                 str(idempotency_ttl_s)]
    else:
        args += ["", "", ""]
    script_keys += enqueue_keys
    args += enqueue_args
    for hit in hits:
        fields = hit.to_redis()
        script_keys.append(keys.job(hit.id))
        args += [str(len(fields)), *chain.from_iterable(fields.items())]
    return script_keys, args
