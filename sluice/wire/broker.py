"""The job broker on Redis: the API's verbs on jobs (submit, read, cancel, idempotency, events).

The stream protocol itself (entries, the consumer group, the transition scripts' arguments) is
`sluice.wire.streams`, the scripts themselves `sluice.wire.scripts`; this module is what a
submitter needs of it. The client is built by the caller and passed in.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from collections.abc import Sequence
from typing import Any, cast

import redis.asyncio as aioredis
from redis import exceptions as redis_errors
from redis.commands.core import AsyncScript

from sluice.errors import BrokerError, Conflict, NotDurable, NotFound
from sluice.vocabulary import Lane
from sluice.wire import events, keys, quota, scripts
from sluice.wire.connections import is_cluster, reply_text, translate_redis_errors
from sluice.wire.durability import fsynced, wait_fsynced
from sluice.wire.idempotency import LEASE_S, IdempotencyClaim, IdempotencyRecord
from sluice.wire.jobs import JobRecord, JobStatus, JobView
from sluice.wire.placements import PlacementPlan, version_name
from sluice.wire.quota import Refusal, TenantLimits, admit_call
from sluice.wire.samples import Sample, read_samples
from sluice.wire.script_calls import queue_call
from sluice.wire.streams import free_places

log = logging.getLogger(__name__)

LaneKey = tuple[str, str, str]  # (model, version, lane)


def _numbers(pipe: Any, lane_key: LaneKey) -> None:
    """Queue on `pipe` a lane's two job numbers: how many the queue script has numbered, and the
    highest a worker has read (`keys.queue_added`, `keys.queue_read`)."""
    model, version, lane = lane_key
    stream = keys.stream(model, version, cast(Lane, lane))
    pipe.zscore(keys.queue_added(model, version), stream)
    pipe.zscore(keys.queue_read(model, version), stream)


class Broker:
    """Submit, read, cancel and announce jobs; one instance per process over a shared client."""

    def __init__(self, *, redis: aioredis.Redis, result_ttl_s: int, idempotency_ttl_s: int = 86_400,
                 idempotency_lease_s: float = LEASE_S, durable_timeout_ms: int | None = None) -> None:
        self.redis = redis
        self.result_ttl_s = result_ttl_s
        self.idempotency_ttl_s = idempotency_ttl_s
        self.idempotency_lease_s = idempotency_lease_s
        # Set: durable accept (sluice.wire.durability), waiting up to this long for the fsync.
        self.durable_timeout_ms = durable_timeout_ms
        self._admit = redis.register_script(scripts.ADMIT)
        self._admit_queue = redis.register_script(scripts.ADMIT_QUEUE)
        # On one server the admission and the write run as one script; a cluster keeps the
        # tenant's keys and the version's in different slots, so there they run apart.
        self._one_step = not is_cluster(redis)
        self._cancel = redis.register_script(scripts.CANCEL)
        self._complete = redis.register_script(scripts.IDEMPOTENCY_COMPLETE)
        self._queue = redis.register_script(scripts.QUEUE)
        self._release = redis.register_script(scripts.IDEMPOTENCY_RELEASE)
        self._withdraw = redis.register_script(scripts.WITHDRAW)

    async def enqueue(self, records: Sequence[JobRecord], *, limits: TenantLimits,
                      idempotency: IdempotencyClaim | None = None, window: int = 0) -> Refusal | None:
        """Queue one submission's jobs if the tenant's quota, bound on stored answers and rate
        allow, and complete its Idempotency-Key; answer the refusal otherwise, with nothing written.
        Jobs answered from the response cache (`cache_hit`, in input order among the others) are
        written final in the same step as the others: they take no quota place (but must fit under
        the quota), a place among the tenant's stored answers, and `limits.hit_cost` rate tokens.

        On one server, one round trip (admit_queue.lua) admits and writes; on a Redis Cluster
        two, each atomic in one slot: admission charges the tenant (admit.lua), queue.lua writes
        the jobs. Then idempotency_complete.lua completes the key. Should the write fail, the
        places (and stored answers) are given back. In durable mode the write waits for the
        fsync; unconfirmed, the queued jobs are withdrawn and NotDurable (503) raised.
        """
        queued = [record for record in records if not record.cache_hit]
        marker, redis_key = (idempotency.marker, idempotency.redis_key) if idempotency else (None, None)
        admit_keys, admit_args = admit_call(records, limits=limits, now=time.time(), result_ttl_s=self.result_ttl_s,
                                            marker=marker, redis_key=redis_key, lease_s=self.idempotency_lease_s)
        script_keys, args = queue_call(records, result_ttl_s=self.result_ttl_s, window=window)
        with translate_redis_errors():
            if any(record.callback_url for record in records):
                # Before the jobs: a relay must know the outbox before it can hold an entry.
                first = records[0]
                await self.redis.sadd(keys.WEBHOOK_OUTBOXES, keys.outbox(first.model, first.version))
            if not self._one_step:
                refusal = self._refusal(await self._admit(keys=admit_keys, args=admit_args))
                if refusal is not None:
                    return refusal
        try:
            if self._one_step:
                reply, fsync = await self._write(self._admit_queue, [*admit_keys, *script_keys],
                                                 [str(len(admit_keys)), str(len(admit_args)), *admit_args, *args])
                refusal = self._refusal(reply)
                if refusal is not None:
                    return refusal
            else:
                _, fsync = await self._write(self._queue, script_keys, args)
        except BaseException:
            await self._give_back(limits.tenant, [record.id for record in queued],
                                  answered=[record.id for record in records if record.cache_hit])
            raise
        answers = [record.id for record in records]
        if self.durable_timeout_ms is not None and not fsynced(fsync):
            await self._withdraw_unconfirmed(queued, limits.tenant, idempotency, answers, fsync)
        if idempotency is not None:
            await self._complete_key(idempotency, answers)
        return None

    @staticmethod
    def _refusal(reply: Any) -> Refusal | None:
        verdict, value = quota.verdict(reply)
        if verdict == "lost":
            raise Conflict("this request held its Idempotency-Key too long and another request took it; "
                           "retry to get that request's answer", headers={"Retry-After": "1"})
        if verdict == "quota":
            return Refusal(verdict, queued=int(value))
        if verdict != "ok":
            return Refusal(verdict, wait_s=value)
        return None

    async def _write(self, script: AsyncScript, script_keys: list[str], args: list[str]) -> tuple[Any, object]:
        """Run a script that writes jobs: its reply, and in durable mode the answer of the wait for
        its fsync that follows it on the same connection (None otherwise)."""
        with translate_redis_errors():
            if self.durable_timeout_ms is None:
                return await script(keys=script_keys, args=args), None
            for attempt in (1, 2):
                pipe = self.redis.pipeline(transaction=False)
                # EVALSHA by name: the cluster pipeline blocks its evalsha() method, not the command.
                pipe.execute_command("EVALSHA", script.sha, len(script_keys), *script_keys, *args)
                wait_fsynced(pipe, self.durable_timeout_ms, near=script_keys[0])
                reply, fsync = await pipe.execute(raise_on_error=False)
                if isinstance(reply, redis_errors.NoScriptError) and attempt == 1:
                    # A pipeline does not load scripts: load it (on every node) and go again.
                    await self.redis.script_load(script.script)
                    continue
                if isinstance(reply, Exception):
                    raise reply
                return reply, fsync
        raise AssertionError("unreachable")

    async def _give_back(self, tenant: str, job_ids: list[str], *, answered: Sequence[str] = ()) -> None:
        """The places and stored answers a submission took and did not use (its write failed).
        Best effort: what is not given back frees itself (`sluice.wire.quota`)."""
        try:
            with translate_redis_errors():
                await free_places(self.redis, [(tenant, job_id) for job_id in job_ids])
                if answered:
                    await self.redis.zrem(keys.answered_jobs(tenant), *answered)
        except BrokerError as exc:
            log.warning("could not give back %d quota place(s) of a failed submission: %s", len(job_ids), exc)

    async def _complete_key(self, claim: IdempotencyClaim, answers: list[str]) -> None:
        with translate_redis_errors():
            done = await self._complete(keys=[claim.redis_key],
                                        args=[claim.marker, claim.completed(answers), str(self.idempotency_ttl_s)])
        if not done:
            # Admission renewed the lease milliseconds ago: only a write slower than the lease gets here.
            log.warning("an Idempotency-Key lapsed while its jobs were written; a retry with it queues them again")

    async def _withdraw_unconfirmed(self, records: Sequence[JobRecord], tenant: str,
                                    idempotency: IdempotencyClaim | None, answers: list[str], reply: object) -> None:
        """Undo the queueing of jobs whose fsync was not confirmed, so a 503 leaves nothing behind.

        A job a worker took in the meantime cannot be withdrawn: it runs, and a client that
        submits again may have it run twice (at least once, as everywhere else); with an
        Idempotency-Key and every job started, the key is completed and a retry replays them.
        Cache hits (in `answers`, not in `records`) are final already and stay.
        """
        with translate_redis_errors():
            withdrawn = [reply_text(job_id) for job_id in
                         await self._withdraw(keys=[keys.job(r.id) for r in records])] if records else []
            await self._give_back(tenant, withdrawn)
            started = len(records) - len(withdrawn)
            if idempotency is not None:
                if withdrawn:
                    await self._release(keys=[idempotency.redis_key], args=[idempotency.marker])
                else:
                    await self._complete_key(idempotency, answers)
        why = reply if isinstance(reply, Exception) else f"WAITAOF answered {reply!r}"
        outcome = (f"{started} job(s) a worker had already started will run, the rest were withdrawn" if started
                   else "nothing was queued")
        raise NotDurable(f"the job queue did not confirm writing the job to disk ({why}); {outcome}; retry",
                         headers={"Retry-After": "1"})

    async def get(self, job_id: str) -> JobRecord | None:
        with translate_redis_errors():
            raw = await self.redis.hgetall(keys.job(job_id))
        return JobRecord.from_redis(raw) if raw else None

    async def get_many(self, job_ids: Sequence[str]) -> list[JobRecord | None]:
        """The records of `job_ids` in one round trip, None where a record has expired."""
        with translate_redis_errors():
            pipe = self.redis.pipeline(transaction=False)
            for job_id in job_ids:
                pipe.hgetall(keys.job(job_id))
            replies = await pipe.execute()
        return [JobRecord.from_redis(raw) if raw else None for raw in replies]

    async def get_for_tenant(self, job_id: str, tenant: str) -> JobRecord:
        """Another tenant's job answers exactly like a missing one: nothing leaks its existence."""
        record = await self.get(job_id) if job_id.startswith("job_") else None
        if record is None or record.tenant != tenant:
            raise NotFound(f"job '{job_id}' does not exist")
        return record

    async def view_for_tenant(self, job_id: str, tenant: str) -> JobView:
        """The job as its owner reads it (`JobView`: the resource, its output not parsed); another
        tenant's job answers like a missing one."""
        raw = None
        if job_id.startswith("job_"):
            with translate_redis_errors():
                raw = await self.redis.hgetall(keys.job(job_id))
        view = JobView.from_redis(raw) if raw else None
        if view is None or view.tenant != tenant:
            raise NotFound(f"job '{job_id}' does not exist")
        return view

    async def lane_progress(self, lanes: Sequence[LaneKey], job_ids: Sequence[str] = ()
                            ) -> tuple[dict[LaneKey, tuple[int, int]], set[str]]:
        """Per (model, version, lane): how many jobs the queue script has numbered in it, and the
        highest number a worker has read (`keys.queue_added`, `keys.queue_read`); and which of
        `job_ids` are still queued when they were read. One round trip, the jobs' statuses read
        after the lanes: a job still queued then was not claimed before the reading was, so its
        number is past the highest one read, unless another worker's later read was noted first."""
        wanted = list(dict.fromkeys(lanes))
        with translate_redis_errors():
            pipe = self.redis.pipeline(transaction=False)
            for lane_key in wanted:
                _numbers(pipe, lane_key)
            for job_id in job_ids:
                pipe.hget(keys.job(job_id), "status")
            replies = await pipe.execute()
        progress = {lane: (int(replies[2 * i] or 0), int(replies[2 * i + 1] or 0)) for i, lane in enumerate(wanted)}
        statuses = replies[2 * len(wanted):]
        queued = {job_id for job_id, status in zip(job_ids, statuses, strict=True)
                  if reply_text(status) == JobStatus.queued.value}
        return progress, queued

    async def held_places(self, jobs: Sequence[JobRecord | JobView]
                          ) -> tuple[dict[str, int], dict[LaneKey, dict[tuple[int, str], int]],
                                     dict[LaneKey, tuple[int, int]]]:
        """Of queued jobs not yet in their stream (held by queue.lua): how many jobs are ahead of
        each in its own held queue, per lane its held queues' counts, and per lane its numbers
        added and read (as `lane_progress`). One round trip; a job released meanwhile has no place
        here. On one server the round trip is a transaction: a release between the places and
        the numbers would count the jobs it moved twice, in the queue and as unread, and a job's
        place would rise."""
        lanes = list(dict.fromkeys(job.lane_key for job in jobs))
        with translate_redis_errors():
            pipe = self.redis.pipeline(transaction=self._one_step)
            for job in jobs:
                model, version, lane = job.lane_key
                prefix = keys.held_queue_prefix(model, version, cast(Lane, lane))
                pipe.lpos(f"{prefix}{job.priority}|{job.tenant}", keys.job(job.id))
            for model, version, lane in lanes:
                pipe.hgetall(keys.held_index(model, version, cast(Lane, lane)))
                _numbers(pipe, (model, version, lane))
            replies = await pipe.execute()
        places = {job.id: int(place) for job, place in zip(jobs, replies, strict=False) if place is not None}
        held: dict[LaneKey, dict[tuple[int, str], int]] = {}
        progress: dict[LaneKey, tuple[int, int]] = {}
        rest = replies[len(jobs):]
        for i, lane_key in enumerate(lanes):
            counts, added, read = rest[3 * i:3 * i + 3]
            progress[lane_key] = (int(added or 0), int(read or 0))
            held[lane_key] = {}
            for name, count in counts.items():
                priority, _, tenant = reply_text(name).partition("|")
                if tenant:
                    held[lane_key][(int(priority), tenant)] = int(count)
        return places, held, progress

    async def scaling_decisions(self, versions: list[tuple[str, str]]) -> dict[tuple[str, str], dict[str, Any]]:
        """The scheduler's last decision per (model, version) (`scheduler/scaling.py` writes them),
        where one was made in the last minute: `{"desired", "live", "reason", "processes",
        "not_served", "scale_to_zero"}`, the processes being the placement groups serving it and what each shares
        with it (`sluice.wire.placements`). One round trip."""
        with translate_redis_errors():
            pipe = self.redis.pipeline(transaction=False)
            pipe.get(keys.placements())
            for model, version in versions:
                pipe.hgetall(keys.replicas(model, version))
            raw_plan, *replies = await pipe.execute()
        plan = PlacementPlan.from_json(raw_plan)
        decisions = {}
        for key, raw in zip(versions, replies, strict=True):
            if raw:
                data = {k.decode(): v.decode() for k, v in raw.items()}
                groups = plan.groups_of(key) if plan else []
                decisions[key] = {
                    "desired": int(data["desired"]), "live": int(data["live"]), "reason": data["reason"],
                    "scale_to_zero": data.get("zero") or None,
                    "processes": [{"group": name, "tier": plan.groups[name].tier,
                                   "shares_with": plan.shares_with(key, name)} for name in groups] if plan else [],
                    "not_served": plan.not_served.get(version_name(key)) if plan else None}
        return decisions

    async def cancel(self, record: JobRecord) -> str | None:
        """Cancel a queued job; answer None when done, else the state that prevents it."""
        outbox = keys.outbox(record.model, record.version)
        with translate_redis_errors():
            if record.callback_url:
                await self.redis.sadd(keys.WEBHOOK_OUTBOXES, outbox)
            outcome = await self._cancel(keys=[keys.job(record.id), outbox], args=[repr(time.time())])
            state = reply_text(outcome)
            if state != "ok":
                return state
            await free_places(self.redis, [(record.tenant, record.id)])
        await self.publish(events.JobChanged(id=record.id, status=JobStatus.cancelled))
        return None

    # --- Idempotency-Key ---------------------------------------------------------------------------

    async def claim_idempotency_key(self, tenant: str, key: str, request_hash: str) -> IdempotencyClaim:
        """Claim `key` for this request, or answer the job ids an earlier identical request made.

        Conflict when the key was used with another body, or its first request is still running
        (a claim lapses after `idempotency_lease_s`: one left by an API that died frees itself).
        """
        redis_key = keys.idempotency(tenant, hashlib.sha256(key.encode()).hexdigest())
        marker = IdempotencyRecord(request_hash, None, owner=secrets.token_hex(8)).encode()
        with translate_redis_errors():
            if await self.redis.set(redis_key, marker, nx=True, px=max(1, int(self.idempotency_lease_s * 1000))):
                return IdempotencyClaim(redis_key, request_hash, marker=marker)
            stored = await self.redis.get(redis_key)
        # Lapsed between the two commands: answered as still running, so the retry claims it afresh.
        previous = IdempotencyRecord.parse(stored) if stored else IdempotencyRecord(request_hash, None)
        if previous.request_hash != request_hash:
            raise Conflict("this Idempotency-Key was already used with a different request body")
        if previous.job_ids is None:
            raise Conflict("a request with this Idempotency-Key is still being processed",
                           headers={"Retry-After": "1"})
        return IdempotencyClaim(redis_key, request_hash, replay=previous.job_ids)

    async def release_idempotency_key(self, claim: IdempotencyClaim) -> None:
        """The request failed before queueing anything: a retry with the key must run it again."""
        with translate_redis_errors():
            await self._release(keys=[claim.redis_key], args=[claim.marker])

    async def samples(self, model: str, version: str, *, window_s: float) -> list[Sample]:
        return await read_samples(self.redis, model, version, window_s=window_s)

    # --- events and health -------------------------------------------------------------------------

    async def publish(self, event: events.Sent) -> None:
        await events.publish(self.redis, event)

    async def ping(self) -> None:
        with translate_redis_errors():
            await self.redis.ping()
