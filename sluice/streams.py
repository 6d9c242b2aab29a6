"""The stream protocol of one model version: what its streams carry and how they are consumed.

This module owns the `workers` consumer group end to end, as dramatiq's RedisBroker owns its
consumer: queueing a job (record, then entry), reading with the group, reclaiming what a dead
consumer left pending, claiming an entry's job (queued -> running), finishing it, noting an error,
dead-lettering and acknowledging, and the Lua scripts behind the transitions. The job record's
fields are `sluice.jobs`'; the heartbeat is `sluice.heartbeats`'.

Transitions run in small scripts so that a cancel racing a worker, or a job delivered twice, still
ends with exactly one final record: a final state is never overwritten.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import redis.asyncio as aioredis

from sluice import events, heartbeats, keys, samples
from sluice.connections import translate_redis_errors
from sluice.errors import BrokerError
from sluice.idempotency import IdempotencyClaim
from sluice.jobs import JobRecord
from sluice.keys import Lane
from sluice.outbox import QUEUE_WEBHOOK
from sluice.quota import TENANT_LUA, TenantLimits, frees_at
from sluice.redact import scrub

DEAD_LETTER_MAXLEN = 100_000

# KEYS[1] job hash, KEYS[2] the tenant's queued set, KEYS[3] the webhook outbox; ARGV: now,
# worker, max_deliveries. Moves queued/running -> running and hands back the input. A job already
# final answers its state and is not re-run; one past its deadline becomes `expired`, one
# delivered max_deliveries times becomes `failed` (the caller dead-letters it).
CLAIM_SCRIPT = QUEUE_WEBHOOK + """
local s = redis.call('HGET', KEYS[1], 'status')
if not s then return {'missing'} end
if s ~= 'queued' and s ~= 'running' then return {s} end
if s == 'queued' then redis.call('ZREM', KEYS[2], redis.call('HGET', KEYS[1], 'id')) end
local deadline = tonumber(redis.call('HGET', KEYS[1], 'deadline') or '')
if deadline and tonumber(ARGV[1]) > deadline then
  redis.call('HSET', KEYS[1], 'status', 'expired', 'finished_at', ARGV[1],
    'error', '{"code":"expired","message":"the job deadline passed before it started"}')
  queue_webhook(KEYS[1], KEYS[3])
  return {'expired'}
end
local attempts = tonumber(redis.call('HGET', KEYS[1], 'attempts') or '0')
if attempts >= tonumber(ARGV[3]) then
  local last = redis.call('HGET', KEYS[1], 'last_error') or 'its worker died while running it'
  redis.call('HSET', KEYS[1], 'status', 'failed', 'finished_at', ARGV[1],
    'error', cjson.encode({code='max_deliveries',
      message='delivered ' .. attempts .. ' times without finishing; last error: ' .. last}))
  queue_webhook(KEYS[1], KEYS[3])
  return {'dead', last}
end
redis.call('HSET', KEYS[1], 'status', 'running', 'worker', ARGV[2])
redis.call('HINCRBY', KEYS[1], 'attempts', 1)
return {'run', redis.call('HGET', KEYS[1], 'input'), tostring(attempts + 1)}
"""

# KEYS[1] job hash, KEYS[2] the webhook outbox; ARGV: status, output-or-'', error-or-'',
# finished_at, model_ms, batch_size, close_reason, ttl_s, started_at. Optionally KEYS[3] the
# version's samples stream and ARGV: the events channel, the event or '', the stream's cap, then
# the sample's fields (`samples.script_args`). Writes the outcome once; a second delivery of a
# finished job is a no-op, so a job processed twice still has one final record, one webhook, one
# sample and one event: only the write that wins counts. Answers 1 for that write, else 0.
FINISH_SCRIPT = QUEUE_WEBHOOK + """
local s = redis.call('HGET', KEYS[1], 'status')
if not s then return 0 end
if s ~= 'queued' and s ~= 'running' then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'finished_at', ARGV[4], 'model_ms', ARGV[5],
  'batch_size', ARGV[6], 'close_reason', ARGV[7], 'started_at', ARGV[9])
if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], 'output', ARGV[2]) end
if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'error', ARGV[3]) end
queue_webhook(KEYS[1], KEYS[2])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[8]))
if KEYS[3] then
  if ARGV[11] ~= '' then redis.call('PUBLISH', ARGV[10], ARGV[11]) end
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[12], '*', unpack(ARGV, 13))
end
return 1
"""

# KEYS[1] job hash; ARGV: message. Remembered so that dead-lettering can say why.
NOTE_ERROR_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'last_error', ARGV[1]) end
return 1
"""

# KEYS[1] a lane's stream; ARGV: group, consumer, then entry ids. A worker keeps the entries it
# holds (in its batcher, on its model, being stored) from looking idle to XAUTOCLAIM: it claims
# again each one still pending under its own name, JUSTID, which resets the idle time without
# counting a delivery. An id pending under another consumer (taken over while this one stalled)
# or no longer pending (acknowledged) is never claimed back; those ids are answered.
REFRESH_SCRIPT = """
local mine, lost = {}, {}
for i = 3, #ARGV do
  if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2]) == 1 then
    mine[#mine + 1] = ARGV[i]
  else
    lost[#lost + 1] = ARGV[i]
  end
end
for first = 1, #mine, 1000 do
  local args = {'XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0}
  for i = first, math.min(first + 999, #mine) do args[#args + 1] = mine[i] end
  args[#args + 1] = 'JUSTID'
  redis.call(unpack(args))
end
return lost
"""

# KEYS[1] job hash, KEYS[2] the tenant's queued set, KEYS[3] the webhook outbox; ARGV: now.
# Only a queued job can be cancelled: answers 'ok', or the state that prevents it (an already
# cancelled job included).
CANCEL_SCRIPT = QUEUE_WEBHOOK + """
local s = redis.call('HGET', KEYS[1], 'status')
if not s then return 'missing' end
if s ~= 'queued' then return s end
redis.call('ZREM', KEYS[2], redis.call('HGET', KEYS[1], 'id'))
redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finished_at', ARGV[1])
queue_webhook(KEYS[1], KEYS[3])
return 'ok'
"""

# KEYS[1] the tenant's queued-jobs set, KEYS[2] the Idempotency-Key when ARGV[1] is the completed
# record ENQUEUE_SCRIPT wrote there (else ''), then the jobs' hashes. Undoes ENQUEUE_SCRIPT for
# the jobs still queued (durable accept, when the fsync was not confirmed): each record and its
# place in the quota go; the entry stays, and a worker settles it as `missing`. The key is freed
# for a retry unless every job had been started (a retry with it then replays them). Answers how
# many had been started.
WITHDRAW_SCRIPT = """
local first = 2
if ARGV[1] ~= '' then first = 3 end
local started = 0
for k = first, #KEYS do
  if redis.call('HGET', KEYS[k], 'status') == 'queued' then
    redis.call('ZREM', KEYS[1], redis.call('HGET', KEYS[k], 'id'))
    redis.call('DEL', KEYS[k])
  else
    started = started + 1
  end
end
if first == 3 and started < #KEYS - 2 and redis.call('GET', KEYS[2]) == ARGV[1] then
  redis.call('DEL', KEYS[2])
end
return started
"""


def _text(value: bytes | str | None) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else value


@dataclass(frozen=True, slots=True)
class StreamEntry:
    """What a lane's stream carries: enough to batch without reading the job record."""

    job_id: str
    tenant: str
    cost: int
    enqueued_at: float
    shadow: str | None = None  # copy the input to this version once the job succeeds
    shadow_of: str | None = None  # this job is a shadow copy of that primary job

    @classmethod
    def of(cls, record: JobRecord) -> StreamEntry:
        return cls(job_id=record.id, tenant=record.tenant, cost=record.cost, enqueued_at=record.enqueued_at,
                   shadow=record.shadow, shadow_of=record.shadow_of)

    def to_fields(self) -> dict[str, str]:
        fields = {"id": self.job_id, "tenant": self.tenant, "cost": str(self.cost), "t": repr(self.enqueued_at)}
        if self.shadow:
            fields["sh"] = self.shadow
        if self.shadow_of:
            fields["so"] = self.shadow_of
        return fields

    @classmethod
    def from_fields(cls, fields: Mapping[bytes, bytes]) -> StreamEntry:
        return cls(job_id=fields[b"id"].decode(), tenant=fields[b"tenant"].decode(), cost=int(fields[b"cost"]),
                   enqueued_at=float(fields[b"t"]), shadow=_text(fields.get(b"sh")) or None,
                   shadow_of=_text(fields.get(b"so")) or None)


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """An entry of `keys.dead_stream`: a job given up after max_deliveries, with the last error."""

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


# KEYS[1] the lane stream, KEYS[2] the tenant's queued set, KEYS[3] its rate bucket, then the
# Idempotency-Key record if ARGV[6] is not '', then one job hash per job. ARGV: now, max_queued,
# rate/s, burst, result_ttl_s, the key's in-progress marker or '', its completed record,
# idempotency_ttl_s; the record fields every job shares (their number, then name, value pairs),
# the entry fields every job shares (likewise); then per job: id, when its quota place frees
# (`quota.frees_at`), the number of its own record fields and the fields, the number of its own
# entry fields and the fields. (The jobs of one submission differ in little more than id and
# input: sent once, the shared fields cut a bulk submission's arguments by two thirds.)
# Checks, then charges, in this order: the key is still this request's claim ({'lost'}), the
# quota ({'quota', queued jobs}), the rate ({'rate', seconds to wait}); then writes every record,
# entry and quota place, and completes the key: {'ok'}. A refusal writes nothing.
ENQUEUE_SCRIPT = TENANT_LUA + """
local now, ttl = tonumber(ARGV[1]), tonumber(ARGV[5])
local first = 4
if ARGV[6] ~= '' then
  if redis.call('GET', KEYS[4]) ~= ARGV[6] then return {'lost'} end
  first = 5
end
local count = #KEYS - first + 1
local queued = queued_jobs(KEYS[2], ARGV[1])
if queued + count > tonumber(ARGV[2]) then return {'quota', queued} end
local wait = take_tokens(KEYS[3], tonumber(ARGV[3]), tonumber(ARGV[4]), now, count)
if wait then return {'rate', tostring(wait)} end
local n = tonumber(ARGV[9])
local record = {unpack(ARGV, 10, 9 + 2 * n)}
local i = 10 + 2 * n
local m = tonumber(ARGV[i])
local entry = {unpack(ARGV, i + 1, i + 2 * m)}
i = i + 1 + 2 * m
for k = first, #KEYS do
  local id, frees_at, own = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  redis.call('HSET', KEYS[k], unpack(ARGV, i + 3, i + 2 + 2 * own))
  if n > 0 then redis.call('HSET', KEYS[k], unpack(record)) end
  redis.call('EXPIRE', KEYS[k], ttl)
  i = i + 3 + 2 * own
  own = tonumber(ARGV[i])
  local fields = {unpack(ARGV, i + 1, i + 2 * own)}
  for _, part in ipairs(entry) do fields[#fields + 1] = part end
  redis.call('XADD', KEYS[1], '*', unpack(fields))
  i = i + 1 + 2 * own
  redis.call('ZADD', KEYS[2], frees_at, id)
end
redis.call('EXPIRE', KEYS[2], ttl)
if first == 5 then redis.call('SET', KEYS[4], ARGV[7], 'EX', ARGV[8]) end
return {'ok'}
"""

EnqueueVerdict = Literal["ok", "lost", "quota", "rate"]


def queue_jobs(pipe: Any, records: Sequence[JobRecord], *, result_ttl_s: int) -> None:
    """Add the commands that queue `records` to a pipeline, unchecked and outside any quota (a
    worker's shadow copies: the platform's work, not a tenant's).

    The record goes first: a worker that reads the entry must always find the job.
    """
    for record in records:
        key = keys.job(record.id)
        pipe.hset(key, mapping=record.to_redis())
        pipe.expire(key, result_ttl_s)
    for record in records:
        pipe.xadd(keys.stream(record.model, record.version, record.lane), StreamEntry.of(record).to_fields())  # type: ignore[arg-type]


def _flat(fields: Mapping[str, str]) -> list[str]:
    return [str(len(fields)), *(part for pair in fields.items() for part in pair)]


def _shared(rows: Sequence[Mapping[str, str]]) -> tuple[dict[str, str], list[dict[str, str]]]:
    """The fields all rows have with one value (never `id`, which names a row, so that each row
    keeps one of its own), and each row's other fields."""
    first, others = rows[0], rows[1:]
    shared = {name: value for name, value in first.items()
              if name != "id" and all(row.get(name) == value for row in others)}
    return shared, [{name: value for name, value in row.items() if name not in shared} for row in rows]


def enqueue_call(records: Sequence[JobRecord], *, limits: TenantLimits, now: float, result_ttl_s: int,
                 idempotency: IdempotencyClaim | None, idempotency_ttl_s: int) -> tuple[list[str], list[str]]:
    """KEYS and ARGV of ENQUEUE_SCRIPT for one submission: one tenant's jobs, for one lane of one
    version (so the stream and the tenant's keys are the same for all)."""
    first = records[0]
    if any((r.tenant, r.model, r.version, r.lane) != (first.tenant, first.model, first.version, first.lane)
           for r in records):
        raise ValueError("one submission queues one tenant's jobs on one lane of one version")
    script_keys = [keys.stream(first.model, first.version, first.lane),  # type: ignore[arg-type]
                   keys.queued_jobs(limits.tenant), keys.rate_bucket(limits.tenant)]
    args = [repr(now), str(limits.max_queued), repr(limits.rate_per_s), str(limits.burst), str(result_ttl_s)]
    if idempotency is None:
        args += ["", "", ""]
    else:
        script_keys.append(idempotency.redis_key)
        args += [idempotency.marker, idempotency.completed([r.id for r in records]), str(idempotency_ttl_s)]
    shared_record, own_records = _shared([record.to_redis() for record in records])
    shared_entry, own_entries = _shared([StreamEntry.of(record).to_fields() for record in records])
    args += [*_flat(shared_record), *_flat(shared_entry)]
    for record, own_record, own_entry in zip(records, own_records, own_entries, strict=True):
        script_keys.append(keys.job(record.id))
        args += [record.id, repr(frees_at(record, result_ttl_s=result_ttl_s)), *_flat(own_record), *_flat(own_entry)]
    return script_keys, args


def enqueue_verdict(reply: list[Any]) -> tuple[EnqueueVerdict, float]:
    """ENQUEUE_SCRIPT's verdict, with the tenant's queued jobs (`quota`) or the seconds until its
    tokens are there (`rate`)."""
    verdict = cast(EnqueueVerdict, _text(reply[0]))
    return verdict, float(_text(reply[1]) or 0) if len(reply) > 1 else 0.0


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
        self.streams: dict[Lane, str] = {lane: keys.stream(model, version, lane) for lane in keys.LANES}
        self._lanes = {name: lane for lane, name in self.streams.items()}
        self._events = events.channel(redis)
        self._claim = redis.register_script(CLAIM_SCRIPT)
        self._finish = redis.register_script(FINISH_SCRIPT)
        self._note_error = redis.register_script(NOTE_ERROR_SCRIPT)
        self._refresh = redis.register_script(REFRESH_SCRIPT)

    async def ensure_groups(self) -> None:
        """Create the consumer group on both lanes (and the streams) if missing."""
        for stream_name in self.streams.values():
            try:
                with translate_redis_errors():
                    await self.redis.xgroup_create(stream_name, keys.GROUP, id="0", mkstream=True)
            except BrokerError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def read(self, lanes: Sequence[Lane], *, count: int, block_ms: int | None) -> list[Delivered]:
        """New entries of `lanes` (in that order of preference when several have some)."""
        with translate_redis_errors():
            reply: list[Any] = await self.redis.xreadgroup(  # type: ignore[assignment]
                keys.GROUP, self.name, {self.streams[lane]: ">" for lane in lanes}, count=count, block=block_ms)
        found: list[Delivered] = []
        for stream_name, messages in reply or []:
            lane = self._lanes[_text(stream_name) or ""]
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
        """Move each entry's job queued -> running, in one round trip; see CLAIM_SCRIPT."""
        with translate_redis_errors():
            pipe = self.redis.pipeline(transaction=False)
            for item in delivered:
                await self._claim(keys=[keys.job(item.entry.job_id), keys.queued_jobs(item.entry.tenant),
                                        keys.WEBHOOK_OUTBOX],
                                  args=[repr(now), self.name, self.max_deliveries], client=pipe)
            replies = await pipe.execute()
        claims = []
        for reply in replies:
            verdict = reply[0].decode()
            if verdict == "run":
                claims.append(Claim(verdict, input=json.loads(reply[1]), attempts=int(reply[2])))
            elif verdict == "dead":
                claims.append(Claim(verdict, last_error=reply[1].decode() if len(reply) > 1 else ""))
            else:
                claims.append(Claim(verdict))
        return claims

    async def settle(self, delivered: Sequence[Delivered], *, dead: Sequence[DeadLetter],
                     changed: Sequence[events.JobChanged]) -> None:
        """In one round trip: acknowledge entries whose jobs will not run here (final already,
        expired, given up), dead-letter the given-up ones and announce what changed."""
        with translate_redis_errors():
            pipe = self.redis.pipeline(transaction=False)
            for letter in dead:
                pipe.xadd(keys.dead_stream(self.model, self.version), letter.to_fields(),  # type: ignore[arg-type]
                          maxlen=DEAD_LETTER_MAXLEN, approximate=True)
            for event in changed:
                pipe.publish(self._events, events.encode(event))
            self.ack(pipe, [(d.lane, d.entry_id) for d in delivered])
            await pipe.execute()

    async def finish(self, pipe: Any, job_id: str, *, status: str, output: str, error: str, started: float,
                     finished: float, model_ms: float, batch_size: int, close_reason: str, sample: samples.Sample,
                     event: events.JobChanged | None) -> None:
        """Queue the job's outcome on `pipe` (`output` and `error` are JSON, or ''), with its sample
        and event; its reply is 1 where this write won (see FINISH_SCRIPT)."""
        await self._finish(
            keys=[keys.job(job_id), keys.WEBHOOK_OUTBOX, keys.stats(self.model, self.version)],
            args=[status, output, error, repr(finished), repr(model_ms), str(batch_size), close_reason,
                  self.result_ttl_s, repr(started), self._events, events.encode(event) if event else "",
                  *samples.script_args(sample)],
            client=pipe,
        )

    def ack(self, pipe: Any, entries: Iterable[tuple[Lane, str]]) -> None:
        """Acknowledge and delete: XLEN then equals the backlog the scheduler and admission read."""
        by_lane: dict[Lane, list[str]] = {}
        for lane, entry_id in entries:
            by_lane.setdefault(lane, []).append(entry_id)
        for lane, ids in by_lane.items():
            pipe.xack(self.streams[lane], keys.GROUP, *ids)
            pipe.xdel(self.streams[lane], *ids)

    async def note_error(self, pipe: Any, job_id: str, message: str) -> None:
        """Queue on `pipe`: why the job's delivery ended without an outcome, for its dead letter."""
        await self._note_error(keys=[keys.job(job_id)], args=[scrub(message)[:500]], client=pipe)

    async def refresh(self, held: Mapping[Lane, Collection[str]]) -> set[str]:
        """Keep the entries this consumer holds from being taken over, in one round trip; answer
        the ones it no longer owns (see REFRESH_SCRIPT)."""
        lanes = [(lane, list(ids)) for lane, ids in held.items() if ids]
        if not lanes:
            return set()
        with translate_redis_errors():
            pipe = self.redis.pipeline(transaction=False)
            for lane, ids in lanes:
                await self._refresh(keys=[self.streams[lane]], args=[keys.GROUP, self.name, *ids], client=pipe)
            replies = await pipe.execute()
        return {entry_id.decode() for reply in replies for entry_id in reply}

    async def beat(self, heartbeat: heartbeats.Heartbeat) -> None:
        await heartbeats.beat(self.redis, self.model, self.version, self.name, heartbeat)

    async def leave(self) -> None:
        await heartbeats.forget(self.redis, self.model, self.version, self.name)
