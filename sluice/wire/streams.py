"""The stream protocol of one model version: what its streams carry and how they are consumed.

This module owns the `workers` consumer group end to end, as dramatiq's RedisBroker owns its
consumer: queueing a job (record, then entry), reading with the group, reclaiming what a dead
consumer left pending, claiming an entry's job (queued -> running), finishing it, noting an error,
dead-lettering and acknowledging, with the arguments of the Lua scripts behind the transitions
(sluice/wire/lua/: queue, claim, finish, refresh, cancel, withdraw; loaded by
`sluice.wire.scripts`). The job record's fields are `sluice.wire.jobs`'; the heartbeat is
`sluice.wire.heartbeats`'.

Transitions run in small scripts so that a cancel racing a worker, or a job delivered twice, still
ends with exactly one final record: a final state is never overwritten. Each script touches the
keys of one version's slot only (its streams, its outbox, its jobs' records: `sluice.wire.keys`), so
they run unchanged on a Redis Cluster; what spans slots (a tenant's quota places, shadow copies to
another version) is written beside them, in a second round trip (see ARCHITECTURE, "Redis Cluster").
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from sluice.errors import BrokerError
from sluice.redact import scrub
from sluice.vocabulary import LANES, ClaimVerdict, Lane
from sluice.wire import events, heartbeats, keys, samples, scripts
from sluice.wire.connections import reply_text, translate_redis_errors
from sluice.wire.jobs import SHADOW_TENANT, JobRecord

DEAD_LETTER_MAXLEN = 100_000


@dataclass(frozen=True, slots=True)
class StreamEntry:
    """What a lane's stream carries: enough to batch without reading the job record."""

    job_id: str
    tenant: str
    cost: int
    enqueued_at: float
    shadow: str | None = None  # copy the input to this version once the job succeeds
    shadow_of: str | None = None  # this job is a shadow copy of that primary job
    request_id: str | None = None

    @classmethod
    def of(cls, record: JobRecord) -> StreamEntry:
        return cls(job_id=record.id, tenant=record.tenant, cost=record.cost, enqueued_at=record.enqueued_at,
                   shadow=record.shadow, shadow_of=record.shadow_of, request_id=record.request_id)

    def to_fields(self) -> dict[str, str]:
        fields = {"id": self.job_id, "tenant": self.tenant, "cost": str(self.cost), "t": repr(self.enqueued_at)}
        if self.shadow:
            fields["sh"] = self.shadow
        if self.shadow_of:
            fields["so"] = self.shadow_of
        if self.request_id:
            fields["rq"] = self.request_id
        return fields

    @classmethod
    def from_fields(cls, fields: Mapping[bytes, bytes]) -> StreamEntry:
        return cls(job_id=fields[b"id"].decode(), tenant=fields[b"tenant"].decode(), cost=int(fields[b"cost"]),
                   enqueued_at=float(fields[b"t"]), shadow=reply_text(fields.get(b"sh")) or None,
                   shadow_of=reply_text(fields.get(b"so")) or None, request_id=reply_text(fields.get(b"rq")) or None)


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """An entry of `keys.dead_stream`: a job given up after max_deliveries, with the last error.
    claim.lua writes these fields when it gives a job up."""

    job_id: str
    error: str
    at: float

    def to_fields(self) -> dict[str, str]:
        return {"id": self.job_id, "error": self.error[:500], "t": repr(self.at)}

    @classmethod
    def from_fields(cls, fields: Mapping[bytes, bytes]) -> DeadLetter:
        return cls(job_id=fields[b"id"].decode(), error=fields[b"error"].decode(), at=float(fields[b"t"]))


@dataclass(frozen=True, slots=True)
class Delivered:
    """An entry as the group delivered it to this consumer."""

    lane: Lane
    entry_id: str
    entry: StreamEntry


@dataclass(frozen=True, slots=True)
class Claim:
    """The claim script's verdict on one entry: `run` (with the job's input and attempt number),
    `expired`, `dead` (with the last error), `missing`, or the final state the job already has."""

    verdict: str
    input: dict[str, Any] = field(default_factory=dict)
    attempts: int = 0
    last_error: str = ""


@dataclass(frozen=True, slots=True)
class Finished:
    """One job's outcome as finish.lua stores it: `output` and `error` are JSON, or empty."""

    job_id: str
    lane: Lane
    entry_id: str
    status: str
    output: bytes | str
    error: bytes | str
    sample: samples.Sample
    announce: bool = True  # publish the final state (a shadow copy's is nobody's to wait for)
    copy: JobRecord | None = None  # a shadow copy, queued (`queue_copies`) only if this write wins


def queue_jobs(pipe: Any, records: Sequence[JobRecord], *, result_ttl_s: int) -> None:
    """Add the commands that queue `records` to a pipeline, unchecked and outside any quota (jobs
    queued without the API: tests and benches).

    The record goes first: a worker that reads the entry must always find the job.
    """
    for record in records:
        key = keys.job(record.id)
        pipe.hset(key, mapping=record.to_redis())
        pipe.expire(key, result_ttl_s)
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


async def free_places(redis: aioredis.Redis, jobs: Sequence[tuple[str, str]]) -> None:
    """Free the quota places of (tenant, job id) pairs whose jobs left `queued` (started,
    settled or cancelled): a tenant's places live in its own slot, not the job's, so this follows
    the script that moved the job, in a second round trip. Freeing a place twice, or one never
    taken, does nothing; a place this never frees (its process died in between) frees itself at
    its score (`sluice.wire.quota`)."""
    by_tenant: dict[str, list[str]] = {}
    for tenant, job_id in jobs:
        if tenant != SHADOW_TENANT:
            by_tenant.setdefault(tenant, []).append(job_id)
    if not by_tenant:
        return
    pipe = redis.pipeline(transaction=False)
    for tenant, job_ids in by_tenant.items():
        pipe.zrem(keys.queued_jobs(tenant), *job_ids)
    await pipe.execute()


async def queue_copies(redis: aioredis.Redis, copies: Sequence[JobRecord], *, result_ttl_s: int) -> None:
    """Queue shadow copies, once their primaries' outcomes are stored. A copy goes to another
    version, another slot: a worker that dies between the two round trips loses the copies of
    that batch (shadow traffic is a sample; the primaries are stored)."""
    pipe = redis.pipeline(transaction=False)
    queue_jobs(pipe, copies, result_ttl_s=result_ttl_s)
    await pipe.execute()


def _flat(fields: Mapping[str, str]) -> list[str]:
    return [str(len(fields)), *(part for pair in fields.items() for part in pair)]


def _shared(rows: Sequence[Mapping[str, str]]) -> tuple[dict[str, str], list[dict[str, str]]]:
    """The fields all rows have with one value (never `id`, which names a row, so that each row
    keeps one of its own), and each row's other fields."""
    first, others = rows[0], rows[1:]
    shared = {name: value for name, value in first.items()
              if name != "id" and all(row.get(name) == value for row in others)}
    return shared, [{name: value for name, value in row.items() if name not in shared} for row in rows]


def queue_call(records: Sequence[JobRecord], *, result_ttl_s: int) -> tuple[list[str], list[str]]:
    """KEYS and ARGV of queue.lua for one submission: one tenant's jobs, for one lane of one
    version (so the stream and the outbox are the same for all), those answered from the response
    cache (`cache_hit`) among them."""
    first = records[0]
    if any((r.tenant, r.model, r.version, r.lane) != (first.tenant, first.model, first.version, first.lane)
           for r in records):
        raise ValueError("one submission queues one tenant's jobs on one lane of one version")
    queued = [record for record in records if not record.cache_hit]
    hits = [record for record in records if record.cache_hit]
    script_keys = [keys.stream(first.model, first.version, first.lane),  # type: ignore[arg-type]
                   keys.outbox(first.model, first.version)]
    args = [str(result_ttl_s), str(len(queued))]
    if queued:
        shared_record, own_records = _shared([record.to_redis() for record in queued])
        shared_entry, own_entries = _shared([StreamEntry.of(record).to_fields() for record in queued])
        args += [*_flat(shared_record), *_flat(shared_entry)]
        for record, own_record, own_entry in zip(queued, own_records, own_entries, strict=True):
            script_keys.append(keys.job(record.id))
            args += [*_flat(own_record), *_flat(own_entry)]
    else:
        args += ["0", "0"]
    for hit in hits:
        script_keys.append(keys.job(hit.id))
        args += _flat(hit.to_redis())
    return script_keys, args


def _lane_streams(model: str, version: str) -> list[str]:
    return [keys.stream(model, version, lane) for lane in LANES]


def _lane_number(lane: Lane) -> str:
    """How the claim and finish scripts name a lane: its place in `LANES`, from 1."""
    return str(LANES.index(lane) + 1)


def claim_call(model: str, version: str, delivered: Sequence[Delivered], *, now: float, worker: str,
               max_deliveries: int, channel: str) -> tuple[list[str], list[str]]:
    """KEYS and ARGV of claim.lua for entries of one version."""
    script_keys = [keys.outbox(model, version), keys.dead_stream(model, version), *_lane_streams(model, version)]
    args = [repr(now), worker, str(max_deliveries), channel, keys.GROUP, str(DEAD_LETTER_MAXLEN)]
    for item in delivered:
        script_keys.append(keys.job(item.entry.job_id))
        args += [_lane_number(item.lane), item.entry_id, item.entry.job_id]
    return script_keys, args


def parse_claims(reply: list[Any]) -> list[Claim]:
    claims = []
    for verdict, *rest in reply:
        name = verdict.decode()
        if name == ClaimVerdict.run:
            claims.append(Claim(name, input=json.loads(rest[0]), attempts=int(rest[1])))
        elif name == ClaimVerdict.dead:
            claims.append(Claim(name, last_error=rest[0].decode() if rest else ""))
        else:
            claims.append(Claim(name))
    return claims


def finish_call(model: str, version: str, jobs: Sequence[Finished], *, faults: Sequence[tuple[str, str]] = (),
                channel: str, result_ttl_s: int, started: float, finished: float, model_ms: float, batch_size: int,
                close_reason: str) -> tuple[list[str], list[bytes | str]]:
    """KEYS and ARGV of finish.lua for one batch of one version; `faults` are (job id, message)
    of the jobs whose run faulted."""
    script_keys = [keys.outbox(model, version), keys.stats(model, version), *_lane_streams(model, version)]
    args: list[bytes | str] = [
        str(result_ttl_s), channel, keys.GROUP, str(samples.SAMPLES_MAXLEN), repr(started), repr(finished),
        repr(model_ms), str(batch_size), close_reason, str(len(jobs)),
    ]
    for job in jobs:
        script_keys.append(keys.job(job.job_id))
        args += [job.job_id, _lane_number(job.lane), job.entry_id, job.status, job.output, job.error,
                 "1" if job.announce else "", *_flat(job.sample.to_fields())]
    for job_id, message in faults:
        script_keys.append(keys.job(job_id))
        args.append(scrub(message)[:500])
    return script_keys, args


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
        self._lanes = {name: lane for lane, name in self.streams.items()}
        self._events = events.channel(redis)
        self._claim = redis.register_script(scripts.CLAIM)
        self._finish = redis.register_script(scripts.FINISH)
        self._refresh = redis.register_script(scripts.REFRESH)

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
        """Claim each entry's job and settle the entries whose jobs will not run, in one round
        trip; see claim.lua."""
        script_keys, args = claim_call(self.model, self.version, delivered, now=now, worker=self.name,
                                       max_deliveries=self.max_deliveries, channel=self._events)
        # Called on the client, not queued on a pipeline: a pipeline holding a script first asks
        # the server whether it knows it (SCRIPT EXISTS), one more round trip every time.
        with translate_redis_errors():
            reply = await self._claim(keys=script_keys, args=args)
            await free_places(self.redis, [(item.entry.tenant, item.entry.job_id) for item in delivered])
        return parse_claims(reply)

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
