"""The stream protocol of one model version: what its streams carry and how they are consumed.

This module owns the `workers` consumer group end to end, as dramatiq's RedisBroker owns its
consumer: queueing a job (record, then entry), reading with the group, reclaiming what a dead
consumer left pending, claiming an entry's job (queued -> running), finishing it, noting an error,
dead-lettering and acknowledging, and the Lua scripts behind the transitions. The job record's
fields are `sluice.wire.jobs`'; the heartbeat is `sluice.wire.heartbeats`'.

Transitions run in small scripts so that a cancel racing a worker, or a job delivered twice, still
ends with exactly one final record: a final state is never overwritten. Each script touches the
keys of one version's slot only (its streams, its outbox, its jobs' records: `sluice.wire.keys`), so
they run unchanged on a Redis Cluster; what spans slots (a tenant's quota places, shadow copies to
another version) is written beside them, in a second round trip (docs/ARCHITECTURE.md).
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
from sluice.wire import events, heartbeats, keys, samples
from sluice.wire.connections import reply_text, translate_redis_errors
from sluice.wire.jobs import SHADOW_TENANT, JobRecord
from sluice.wire.outbox import QUEUE_WEBHOOK

DEAD_LETTER_MAXLEN = 100_000

# Lua for the claim and finish scripts, whose KEYS[3] and KEYS[4] are the online and bulk streams:
# acknowledge and delete, in `group`, the entry ids listed per lane (1 online, 2 bulk).
ACK_AND_DROP_LUA = """
local function ack_and_drop(ids_by_lane, group)
  for lane = 1, 2 do
    if #ids_by_lane[lane] > 0 then
      redis.call('XACK', KEYS[lane + 2], group, unpack(ids_by_lane[lane]))
      redis.call('XDEL', KEYS[lane + 2], unpack(ids_by_lane[lane]))
    end
  end
end
"""

# KEYS: the version's webhook outbox, its dead-letter stream, its online and bulk streams, then per
# entry its job hash. ARGV: now, worker, max_deliveries, the events
# channel, the group, the dead letters' cap, then per entry its lane (1 online, 2 bulk), entry id
# and job id. Per entry: queued/running -> running, announced, and the input handed back ({'run',
# input, attempts}). A job already final answers its state ({state}), a vanished one {'missing'};
# one past its deadline becomes `expired`, one delivered max_deliveries times becomes `failed`
# and is dead-lettered ({'dead', last error}), both announced. Every entry whose job will not run
# is acknowledged and deleted in the same step, so claiming a read is one round trip.
CLAIM_SCRIPT = QUEUE_WEBHOOK + events.JOB_CHANGED_LUA + ACK_AND_DROP_LUA + """
local now, worker, max_deliveries, channel = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local function claim(job)
  local s = redis.call('HGET', job, 'status')
  if not s then return {'missing'} end
  if s ~= 'queued' and s ~= 'running' then return {s} end
  local deadline = tonumber(redis.call('HGET', job, 'deadline') or '')
  if deadline and tonumber(now) > deadline then
    redis.call('HSET', job, 'status', 'expired', 'finished_at', now,
      'error', '{"code":"expired","message":"the job deadline passed before it started"}')
    queue_webhook(job, KEYS[1])
    return {'expired'}
  end
  local attempts = tonumber(redis.call('HGET', job, 'attempts') or '0')
  if attempts >= max_deliveries then
    local last = redis.call('HGET', job, 'last_error') or 'its worker died while running it'
    redis.call('HSET', job, 'status', 'failed', 'finished_at', now,
      'error', cjson.encode({code='max_deliveries',
        message='delivered ' .. attempts .. ' times without finishing; last error: ' .. last}))
    queue_webhook(job, KEYS[1])
    return {'dead', last}
  end
  redis.call('HSET', job, 'status', 'running', 'worker', worker)
  redis.call('HINCRBY', job, 'attempts', 1)
  return {'run', redis.call('HGET', job, 'input'), tostring(attempts + 1)}
end
local replies, settled = {}, {{}, {}}
for e = 1, #KEYS - 4 do
  local a = 3 * e + 4
  local lane, entry, id = tonumber(ARGV[a]), ARGV[a + 1], ARGV[a + 2]
  local reply = claim(KEYS[e + 4])
  if reply[1] == 'run' then
    job_changed(channel, id, 'running')
  else
    table.insert(settled[lane], entry)
    if reply[1] == 'expired' then
      job_changed(channel, id, 'expired')
    elseif reply[1] == 'dead' then
      redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[6], '*', 'id', id, 'error', reply[2], 't', now)
      job_changed(channel, id, 'failed')
    end
  end
  replies[e] = reply
end
ack_and_drop(settled, ARGV[5])
return replies
"""

# KEYS: the version's webhook outbox, its samples stream, its online and bulk streams, then per job
# its hash, then the hashes of the faulted jobs. ARGV: ttl_s, the events channel, the group, the
# samples' cap, started_at, finished_at, model_ms, batch_size, close_reason, the number of jobs; per
# job its id, lane (1 online, 2 bulk), entry id, status, output or '', error or '', '1' to announce
# it or '', then its sample (its number of fields and the fields, `_flat`); then one message per
# faulted job.
# A whole batch in one atomic step: each outcome is written once (a job already final is left as
# it is), and only the write that wins adds the job's webhook, event and sample, so a job
# processed twice has one of each (and the worker queues a shadow copy only for a write that won);
# a success whose record names a response-cache key (set at submission, `sluice.wire.response_cache`, a
# key of the version's slot) stores its output there. Then every job's entry is acknowledged and
# deleted: never before its outcome is stored. A faulted job gets no outcome and keeps its entry;
# its message is noted for its dead letter. Answers, per job, 1 where this write won, else 0.
FINISH_SCRIPT = QUEUE_WEBHOOK + events.JOB_CHANGED_LUA + ACK_AND_DROP_LUA + """
local ttl, channel = tonumber(ARGV[1]), ARGV[2]
local k, a = 5, 11
local won, acks = {}, {{}, {}}
for j = 1, tonumber(ARGV[10]) do
  local job, id, lane, entry, status = KEYS[k], ARGV[a], tonumber(ARGV[a + 1]), ARGV[a + 2], ARGV[a + 3]
  local output, err, announce = ARGV[a + 4], ARGV[a + 5], ARGV[a + 6]
  local sample = a + 8
  a = sample + 2 * tonumber(ARGV[a + 7])
  local s = redis.call('HGET', job, 'status')
  won[j] = 0
  if s == 'queued' or s == 'running' then
    redis.call('HSET', job, 'status', status, 'finished_at', ARGV[6], 'model_ms', ARGV[7], 'batch_size', ARGV[8],
      'close_reason', ARGV[9], 'started_at', ARGV[5])
    if output ~= '' then redis.call('HSET', job, 'output', output) end
    if err ~= '' then redis.call('HSET', job, 'error', err) end
    local cache = redis.call('HMGET', job, 'cache_key', 'cache_ttl_s')
    if cache[1] and status == 'succeeded' and output ~= '' then
      redis.call('SET', cache[1], output, 'EX', cache[2])
    end
    queue_webhook(job, KEYS[1])
    redis.call('EXPIRE', job, ttl)
    if announce ~= '' then job_changed(channel, id, status) end
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', unpack(ARGV, sample, a - 1))
    won[j] = 1
  end
  k = k + 1
  table.insert(acks[lane], entry)
end
ack_and_drop(acks, ARGV[3])
for f = k, #KEYS do
  if redis.call('EXISTS', KEYS[f]) == 1 then redis.call('HSET', KEYS[f], 'last_error', ARGV[a]) end
  a = a + 1
end
return won
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

# KEYS[1] job hash, KEYS[2] its version's webhook outbox; ARGV: now. Only a queued job can be
# cancelled: answers 'ok', or the state that prevents it (an already cancelled job included). Its
# quota place is freed by the caller (another slot).
CANCEL_SCRIPT = QUEUE_WEBHOOK + """
local s = redis.call('HGET', KEYS[1], 'status')
if not s then return 'missing' end
if s ~= 'queued' then return s end
redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finished_at', ARGV[1])
queue_webhook(KEYS[1], KEYS[2])
return 'ok'
"""

# KEYS: the jobs' hashes, of one version. Undoes QUEUE_SCRIPT for the jobs still queued (durable
# accept, when the fsync was not confirmed): their records go; the entries stay, and a worker
# settles them as `missing`. Answers the ids withdrawn, whose quota places the caller frees.
WITHDRAW_SCRIPT = """
local withdrawn = {}
for k = 1, #KEYS do
  if redis.call('HGET', KEYS[k], 'status') == 'queued' then
    withdrawn[#withdrawn + 1] = redis.call('HGET', KEYS[k], 'id')
    redis.call('DEL', KEYS[k])
  end
end
return withdrawn
"""


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
    CLAIM_SCRIPT writes these fields when it gives a job up."""

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
    """One job's outcome as FINISH_SCRIPT stores it: `output` and `error` are JSON, or empty."""

    job_id: str
    lane: Lane
    entry_id: str
    status: str
    output: bytes | str
    error: bytes | str
    sample: samples.Sample
    announce: bool = True  # publish the final state (a shadow copy's is nobody's to wait for)
    copy: JobRecord | None = None  # a shadow copy, queued (`queue_copies`) only if this write wins


# KEYS[1] the lane stream, KEYS[2] the version's webhook outbox, then one job hash per queued job,
# then one per job answered from the response cache. ARGV: result_ttl_s, the number of queued
# jobs; the record fields every queued job shares (their number, then name, value pairs), the entry
# fields every one shares (likewise); then per queued job the number of its own record fields and
# the fields, the number of its own entry fields and the fields; then per answered job its record
# (the number of fields, then the fields). (The jobs of one submission differ in little more than
# id and input: sent once, the shared fields cut a bulk submission's arguments by two thirds.)
# Writes every record, then its entry, in one atomic step: a worker that reads an entry always
# finds its job, and a submission is queued whole or not at all. The answered jobs are written
# final with their webhooks queued, as the other scripts that make a job final do; no job-final
# event: nobody can be waiting on a job whose id has not been answered yet. The tenant's admission
# (quota, rate, Idempotency-Key) is checked and charged before, in its own slot (`sluice.wire.quota`).
QUEUE_SCRIPT = QUEUE_WEBHOOK + """
local ttl, count = tonumber(ARGV[1]), tonumber(ARGV[2])
local n = tonumber(ARGV[3])
local record = {unpack(ARGV, 4, 3 + 2 * n)}
local i = 4 + 2 * n
local m = tonumber(ARGV[i])
local entry = {unpack(ARGV, i + 1, i + 2 * m)}
i = i + 1 + 2 * m
for k = 3, 2 + count do
  local own = tonumber(ARGV[i])
  redis.call('HSET', KEYS[k], unpack(ARGV, i + 1, i + 2 * own))
  if n > 0 then redis.call('HSET', KEYS[k], unpack(record)) end
  redis.call('EXPIRE', KEYS[k], ttl)
  i = i + 1 + 2 * own
  own = tonumber(ARGV[i])
  local fields = {unpack(ARGV, i + 1, i + 2 * own)}
  for _, part in ipairs(entry) do fields[#fields + 1] = part end
  redis.call('XADD', KEYS[1], '*', unpack(fields))
  i = i + 1 + 2 * own
end
for h = 3 + count, #KEYS do
  local own = tonumber(ARGV[i])
  redis.call('HSET', KEYS[h], unpack(ARGV, i + 1, i + 2 * own))
  redis.call('EXPIRE', KEYS[h], ttl)
  queue_webhook(KEYS[h], KEYS[2])
  i = i + 1 + 2 * own
end
return 1
"""

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
    """KEYS and ARGV of QUEUE_SCRIPT for one submission: one tenant's jobs, for one lane of one
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
    """KEYS and ARGV of CLAIM_SCRIPT for entries of one version."""
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
    """KEYS and ARGV of FINISH_SCRIPT for one batch of one version; `faults` are (job id, message)
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
        self._claim = redis.register_script(CLAIM_SCRIPT)
        self._finish = redis.register_script(FINISH_SCRIPT)
        self._refresh = redis.register_script(REFRESH_SCRIPT)

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
        trip; see CLAIM_SCRIPT."""
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
        won (see FINISH_SCRIPT)."""
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
        holding some; answer the ones it no longer owns (see REFRESH_SCRIPT)."""
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
