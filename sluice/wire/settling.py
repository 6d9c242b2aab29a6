"""Jobs no worker will run, made final from outside the workers (settle.lua): the scheduler's
sweeper expires queued jobs past their deadline, and retirement fails what a retired version left
unfinished once its drain limit has passed (docs/ARCHITECTURE.md, "No job waits for a worker that
will never come").

Each settled job gets its final state, its webhook and its announcement in one step, and its
tenant's quota place freed after (another slot). A worker that reads such a job's entry later
finds it final and acknowledges it without running it (claim.lua).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

import redis

from sluice.vocabulary import LANES, Lane
from sluice.wire import events, keys, scripts
from sluice.wire.connections import translate_redis_errors
from sluice.wire.jobs import SHADOW_TENANT, JobStatus

VersionKey = tuple[str, str]
EXPIRED = json.dumps({"code": "expired", "message": "the job deadline passed before it started"})
# Deadlines settled per version and call: a backlog of them is worked off over a few ticks.
EXPIRE_BATCH = 500
RETIRE_PAGE = 1000


def retired_error(model: str, version: str) -> str:
    return json.dumps({"code": "version_retired",
                       "message": f"{model}/{version} was retired before this job ran"})


def _settle(client: redis.Redis, model: str, version: str, job_keys: Sequence[str], *, now: float, status: str,
            error: str, running_too: bool, past_deadline: bool) -> int:
    if not job_keys:
        return 0
    with translate_redis_errors():
        replies = client.eval(scripts.SETTLE, 1 + len(job_keys), keys.outbox(model, version),  # type: ignore[misc]
                              *job_keys, repr(now), events.channel(client), status, error,
                              "1" if running_too else "0", "1" if past_deadline else "0")
        settled = [[_text(part) for part in reply] for reply in replies if reply]
        pipe = client.pipeline(transaction=False)
        for tenant, job_id in settled:
            if tenant != SHADOW_TENANT:
                pipe.zrem(keys.queued_jobs(tenant), job_id)
        pipe.execute()
    return len(settled)


def expire_due(client: redis.Redis, versions: Iterable[VersionKey], *, now: float) -> dict[VersionKey, int]:
    """Expire the queued jobs past their deadline of every version; answer how many, by version.

    Every version's index is read in one round trip: most ticks find nothing due anywhere, and
    then that one round trip is the sweeper's whole cost."""
    versions = list(versions)
    with translate_redis_errors():
        pipe = client.pipeline(transaction=False)
        for model, version in versions:
            pipe.zrangebyscore(keys.deadlines(model, version), "-inf", now, start=0, num=EXPIRE_BATCH)
        replies = pipe.execute()
    expired = {}
    for (model, version), found in zip(versions, replies, strict=True):
        due = [_text(key) for key in found]
        if not due:
            continue
        expired[(model, version)] = _settle(client, model, version, due, now=now, status=JobStatus.expired,
                                            error=EXPIRED, running_too=False, past_deadline=True)
        with translate_redis_errors():
            # Settled, running, final or gone: none of them is the sweeper's any more.
            client.zrem(keys.deadlines(model, version), *due)
    return expired


def fail_retired(client: redis.Redis, model: str, version: str, *, now: float) -> int:
    """Fail every job a retired version still has in its streams (`version_retired`), then drop
    its streams and deadline index; answer how many jobs were failed."""
    failed, error = 0, retired_error(model, version)
    for lane in LANES:
        stream, start = keys.stream(model, version, lane), "-"
        while True:
            with translate_redis_errors():
                page = client.xrange(stream, min=start, max="+", count=RETIRE_PAGE)
            if not page:
                break
            job_keys = [keys.job(_field(fields, "id")) for _, fields in page if _field(fields, "id")]
            failed += _settle(client, model, version, job_keys, now=now, status=JobStatus.failed, error=error,
                              running_too=True, past_deadline=False)
            start = "(" + _text(page[-1][0])
        failed += _fail_held(client, model, version, lane, now=now, error=error)
    with translate_redis_errors():
        client.delete(*(keys.stream(model, version, lane) for lane in LANES), keys.deadlines(model, version),
                      keys.queue_added(model, version), keys.queue_read(model, version),
                      *(keys.held_index(model, version, lane) for lane in LANES))
    return failed


def _fail_held(client: redis.Redis, model: str, version: str, lane: Lane, *, now: float, error: str) -> int:
    """Fail the jobs a retired version's lane still holds beside its stream (queue.lua), and drop
    their queues."""
    failed, prefix = 0, keys.held_queue_prefix(model, version, lane)
    with translate_redis_errors():
        queues = [_text(name) for name in client.hkeys(keys.held_index(model, version, lane)) if _text(name) != "*"]
    for queue in queues:
        start = 0
        while True:
            with translate_redis_errors():
                page = client.lrange(prefix + queue, start, start + RETIRE_PAGE - 1)
            if not page:
                break
            failed += _settle(client, model, version, [_text(key) for key in page], now=now,  # type: ignore[union-attr]
                              status=JobStatus.failed, error=error, running_too=True, past_deadline=False)
            start += RETIRE_PAGE
        with translate_redis_errors():
            client.delete(prefix + queue)
    return failed


def _field(fields: object, name: str) -> str:
    return _text(fields.get(name, fields.get(name.encode(), b"")))  # type: ignore[attr-defined]


def _text(raw: object) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)
