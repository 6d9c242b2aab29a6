"""The stream protocol of one model version: what its streams carry and how they are consumed.

This module owns the `workers` consumer group end to end, as dramatiq's RedisBroker owns its
consumer: queueing a job (record, then entry, or held beside the stream while its lane is backed
up), releasing held jobs in fair turns, reading with the group, reclaiming what a dead consumer
left pending, claiming an entry's job (queued -> running), finishing it, noting an error,
dead-lettering and acknowledging, through the Lua scripts behind the transitions
(sluice/wire/lua/: queue, release, claim, finish, refresh, cancel, withdraw; loaded by
`sluice.wire.scripts`). What the streams carry is `sluice.wire.entries`'; the scripts' KEYS and
ARGV are built by `sluice.wire.script_calls`; the job record's fields are `sluice.wire.jobs`'; the
heartbeat is `sluice.wire.heartbeats`'.

Transitions run in small scripts so that a cancel racing a worker, or a job delivered twice, still
ends with exactly one final record: a final state is never overwritten. Each script touches the
keys of one version's slot only (its streams, its outbox, its jobs' records: `sluice.wire.keys`), so
they run unchanged on a Redis Cluster; what spans slots (a tenant's quota places, shadow copies to
another version) is written beside them, in a second round trip (see ARCHITECTURE, "Redis Cluster"); on
one server a claim's quota places go in the same pipeline as its script.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from sluice.errors import BrokerError
from sluice.fair_share import HeldQueue
from sluice.vocabulary import LANES, Lane
from sluice.wire import events, heartbeats, keys, scripts
from sluice.wire.connections import is_cluster, reply_text, translate_redis_errors
from sluice.wire.entries import Delivered, StreamEntry
from sluice.wire.jobs import SHADOW_TENANT, JobRecord
from sluice.wire.script_calls import Claim, Finished, claim_call, finish_call, parse_claims


def queue_jobs(pipe: Any, records: Sequence[JobRecord], *, result_ttl_s: int) -> None:
    """Add the commands that queue `records` to a pipeline, unchecked and outside any quota (jobs
    queued without the API: tests and benches).

    The record goes first: a worker that reads the entry must always find the job.
    """
    for record in records:
        key = keys.job(record.id)
        pipe.hset(key, mapping=record.to_redis())
        pipe.expire(key, result_ttl_s)
        if record.deadline is not None:
            pipe.zadd(keys.deadlines(record.model, record.version), {key: record.deadline})
    for record in records:
        pipe.xadd(keys.stream(record.model, record.version, record.lane), StreamEntry.of(record).to_fields())  # type: ignore[arg-type]


async def ensure_group(redis: aioredis.Redis, stream_name: str, group: str) -> None:
    """Create `group` on `stream_name` (and the stream) from its start, unless it is there."""
    try:
        with translate_redis_errors():
            await redis.xgroup_create(stream_name, group, id="0", mkstream=True)
    except BrokerError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


async def free_places(redis: aioredis.Redis, jobs: Sequence[tuple[str, str]], *,
                      read: tuple[str, Mapping[str, int]] | None = None,
                      held: Sequence[str] = ()) -> list[int]:
    """Free the quota places of (tenant, job id) pairs whose jobs left `queued` (started,
    settled or cancelled): a tenant's places live in its own slot, not the job's, so this follows
    the script that moved the job, in a second round trip. Freeing a place twice, or one never
    taken, does nothing; a place this never frees (its process died in between) frees itself at
    its score (`sluice.wire.quota`). `read`: a version's `keys.queue_read` and, per lane stream,
    the highest job number just read, noted in the same round trip; `held`: lanes' held indexes
    (`keys.held_index`), whose counts of held jobs it answers, in the same round trip."""
    pipe = redis.pipeline(transaction=False)
    if not _queue_free_places(pipe, jobs, read=read, held=held):
        return []
    return _held_counts(await pipe.execute(), held)


def _queue_free_places(pipe: Any, jobs: Sequence[tuple[str, str]], *, read: tuple[str, Mapping[str, int]] | None,
                       held: Sequence[str]) -> bool:
    """Add `free_places`' commands to a pipeline, the held counts' first; whether there were any."""
    by_tenant: dict[str, list[str]] = {}
    for tenant, job_id in jobs:
        if tenant != SHADOW_TENANT:
            by_tenant.setdefault(tenant, []).append(job_id)
    if not by_tenant and not (read and read[1]) and not held:
        return False
    for index in held:
        pipe.hget(index, "*")
    for tenant, job_ids in by_tenant.items():
        pipe.zrem(keys.queued_jobs(tenant), *job_ids)
    if read and read[1]:
        pipe.zadd(read[0], dict(read[1]), gt=True)
    return True


def _held_counts(replies: Sequence[Any], held: Sequence[str]) -> list[int]:
    return [int(count or 0) for count in replies[:len(held)]]


def _highest_seq(streams: Mapping[Lane, str], delivered: Sequence[Delivered]) -> dict[str, int]:
    """Per lane stream, the highest job number among entries just read (`keys.queue_read`)."""
    highest: dict[str, int] = {}
    for item in delivered:
        if item.entry.seq is not None:
            stream = streams[item.lane]
            highest[stream] = max(highest.get(stream, 0), item.entry.seq)
    return highest


async def queue_copies(redis: aioredis.Redis, copies: Sequence[JobRecord], *, result_ttl_s: int) -> None:
    """Queue shadow copies, once their primaries' outcomes are stored. A copy goes to another
    version, another slot: a worker that dies between the two round trips loses the copies of
    that batch (shadow traffic is a sample; the primaries are stored)."""
    pipe = redis.pipeline(transaction=False)
    queue_jobs(pipe, copies, result_ttl_s=result_ttl_s)
    await pipe.execute()


class StreamConsumer:
    """One consumer (one worker process) of one version's lanes in the `workers` group."""

    def __init__(
        self,
        *,
        redis: aioredis.Redis,
        model: str,
        version: str,
        name: str,
        claim_after_s: float,
        max_deliveries: int,
        result_ttl_s: int,
    ) -> None:
        self.redis = redis
        self.model = model
        self.version = version
        self.name = name
        self.claim_after_s = claim_after_s
        self.max_deliveries = max_deliveries
        self.result_ttl_s = result_ttl_s
        self.streams: dict[Lane, str] = {lane: keys.stream(model, version, lane) for lane in LANES}
        self._read_key = keys.queue_read(model, version)
        self._lanes = {name: lane for lane, name in self.streams.items()}
        self._events = events.channel(redis)
        self._claim = redis.register_script(scripts.CLAIM)
        self._finish = redis.register_script(scripts.FINISH)
        self._refresh = redis.register_script(scripts.REFRESH)
        self._release = redis.register_script(scripts.RELEASE)
        self._one_node = not is_cluster(redis)
        self._held_keys = {lane: keys.held_index(model, version, lane) for lane in LANES}
        # Per lane, how many jobs are held (queue.lua) as last seen, and its held queues as the
        # last release saw them: the worker releases while there are some.
        # Unknown at the start, so the first read asks.
        self.held_count: dict[Lane, int] = dict.fromkeys(LANES, 1)
        self.held_queues: dict[Lane, list[HeldQueue]] = {lane: [] for lane in LANES}

    async def ensure_groups(self) -> None:
        """Create the consumer group on both lanes (and the streams) if missing, and make the
        version's webhook outbox known to the relays."""
        with translate_redis_errors():
            await self.redis.sadd(keys.WEBHOOK_OUTBOXES, keys.outbox(self.model, self.version))
        for stream_name in self.streams.values():
            await ensure_group(self.redis, stream_name, keys.GROUP)

    async def read(self, lanes: Sequence[Lane], *, count: int, block_ms: int | None) -> list[Delivered]:
        """New entries of `lanes` (in that order of preference when several have some)."""
        with translate_redis_errors():
            reply: list[Any] = await self.redis.xreadgroup(  # type: ignore[assignment]
                keys.GROUP, self.name, {self.streams[lane]: ">" for lane in lanes}, count=count, block=block_ms)
        found: list[Delivered] = []
        for stream_name, messages in reply or []:
            lane = self._lanes[reply_text(stream_name)]
            found.extend(Delivered(lane, entry_id.decode(), StreamEntry.from_fields(fields))
                         for entry_id, fields in messages if fields)
        return found

    async def reclaim(self, count: int) -> list[Delivered]:
        """Take over entries a dead consumer left pending for longer than claim_after_s."""
        found: list[Delivered] = []
        for lane, stream_name in self.streams.items():
            with translate_redis_errors():
                reply = await self.redis.xautoclaim(
                    stream_name, keys.GROUP, self.name, min_idle_time=int(self.claim_after_s * 1000),
                    start_id="0-0", count=max(1, count - len(found)),
                )
            # Entries trimmed from the stream come back as deleted ids: nothing to acknowledge.
            found.extend(Delivered(lane, entry_id.decode(), StreamEntry.from_fields(fields))
                         for entry_id, fields in reply[1] if fields)
        return found

    async def claim(self, delivered: Sequence[Delivered], *, now: float) -> list[Claim]:
        """Claim each entry's job and settle the entries whose jobs will not run (claim.lua), then
        free their quota places (`free_places`): one round trip on one server, two on a cluster."""
        script_keys, args = claim_call(self.model, self.version, delivered, now=now, worker=self.name,
                                       max_deliveries=self.max_deliveries, channel=self._events)
        jobs = [(item.entry.tenant, item.entry.job_id) for item in delivered]
        read = (self._read_key, _highest_seq(self.streams, delivered))
        held_keys = list(self._held_keys.values())
        with translate_redis_errors():
            if self._one_node:
                reply, held = await self._claim_and_free(script_keys, args, jobs, read=read, held=held_keys)
            else:
                # Called on the client, not queued on a pipeline: a pipeline holding a script object
                # first asks the server whether it knows it (SCRIPT EXISTS), one more round trip.
                reply = await self._claim(keys=script_keys, args=args)
                held = await free_places(self.redis, jobs, read=read, held=held_keys)
        self.held_count.update(zip(self._held_keys, held, strict=True))
        return parse_claims(reply)

    async def _claim_and_free(self, script_keys: Sequence[str], args: Sequence[Any], jobs: Sequence[tuple[str, str]],
                              *, read: tuple[str, Mapping[str, int]], held: Sequence[str]) -> tuple[Any, list[int]]:
        """The claim script and `free_places`' commands in one pipeline: one server runs them in
        that order, so a place is still freed after its job's claim. The script goes by its
        digest; a server that does not know it (restarted) runs the rest all the same, and the
        claim runs again once the script is loaded: freeing those places early takes none that
        their jobs hold, since the worker has read them and is claiming them."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.evalsha(self._claim.sha, len(script_keys), *script_keys, *args)
        _queue_free_places(pipe, jobs, read=read, held=held)
        replies = await pipe.execute(raise_on_error=False)
        reply = replies[0]
        if isinstance(reply, NoScriptError):
            reply = await self._claim(keys=script_keys, args=args)
        elif isinstance(reply, Exception):
            raise reply
        for failed in replies[1:]:
            if isinstance(failed, Exception):
                raise failed
        return reply, _held_counts(replies[1:], held)

    async def release(self, lane: Lane, plan: Sequence[tuple[HeldQueue, int]]) -> None:
        """Move held jobs of `lane` into its stream as `plan` says (`sluice.fair_share.plan_release`),
        and note what stays held (see release.lua)."""
        args = [keys.held_queue_prefix(self.model, self.version, lane)]
        for queue, count in plan:
            args += [f"{queue.priority}|{queue.tenant}", str(count)]
        with translate_redis_errors():
            reply = await self._release(keys=[self.streams[lane], keys.queue_added(self.model, self.version),
                                              self._held_keys[lane]], args=args)
        queues = []
        for i in range(0, len(reply), 5):
            priority, _, tenant = reply_text(reply[i]).partition("|")
            queues.append(HeldQueue(priority=int(priority), tenant=tenant, count=int(reply[i + 1]),
                                    head_enqueued_at=float(reply[i + 2]), head_cost=int(reply[i + 3]),
                                    share=float(reply[i + 4])))
        self.held_queues[lane] = queues
        self.held_count[lane] = sum(queue.count for queue in queues)

    async def finish(self, jobs: Sequence[Finished], *, faults: Sequence[tuple[str, str]], started: float,
                     finished: float, model_ms: float, batch_size: int, close_reason: str) -> list[bool]:
        """Store a batch's outcomes, with their samples, events and shadow copies, note its faults
        and acknowledge its stored jobs, in one round trip; answer, per job, whether this write
        won (see finish.lua)."""
        script_keys, args = finish_call(self.model, self.version, jobs, faults=faults, channel=self._events,
                                        result_ttl_s=self.result_ttl_s, started=started, finished=finished,
                                        model_ms=model_ms, batch_size=batch_size, close_reason=close_reason)
        with translate_redis_errors():
            won = [bool(each) for each in await self._finish(keys=script_keys, args=args)]
            copies = [job.copy for job, wins in zip(jobs, won, strict=True) if wins and job.copy is not None]
            if copies:
                await queue_copies(self.redis, copies, result_ttl_s=self.result_ttl_s)
        return won

    def ack(self, pipe: Any, entries: Iterable[tuple[Lane, str]]) -> None:
        """Acknowledge and delete: XLEN then equals the backlog the scheduler and admission read."""
        by_lane: dict[Lane, list[str]] = {}
        for lane, entry_id in entries:
            by_lane.setdefault(lane, []).append(entry_id)
        for lane, ids in by_lane.items():
            pipe.xack(self.streams[lane], keys.GROUP, *ids)
            pipe.xdel(self.streams[lane], *ids)

    async def refresh(self, held: Mapping[Lane, Collection[str]]) -> set[str]:
        """Keep the entries this consumer holds from being taken over, one round trip per lane
        holding some; answer the ones it no longer owns (see refresh.lua)."""
        lost: set[str] = set()
        for lane, ids in held.items():
            if ids:
                with translate_redis_errors():
                    reply = await self._refresh(keys=[self.streams[lane]], args=[keys.GROUP, self.name, *ids])
                lost.update(entry_id.decode() for entry_id in reply)
        return lost

    async def beat(self, heartbeat: heartbeats.Heartbeat) -> None:
        await heartbeats.beat(self.redis, self.model, self.version, self.name, heartbeat)

    async def leave(self) -> None:
        await heartbeats.forget(self.redis, self.model, self.version, self.name)
