"""The job broker on Redis: the API's verbs on jobs (submit, read, cancel, idempotency, events).

The stream protocol itself (entries, the consumer group, the transition scripts) is
`sluice.streams`; this module is what a submitter needs of it. The client is built by the caller
and passed in.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis

from sluice import events, keys
from sluice.connections import translate_redis_errors
from sluice.durability import fsynced, wait_fsynced
from sluice.errors import Conflict, NotDurable, NotFound
from sluice.idempotency import LEASE_S, RELEASE_SCRIPT, IdempotencyClaim, IdempotencyRecord
from sluice.jobs import JobRecord, JobStatus, JobView
from sluice.quota import Refusal, TenantLimits
from sluice.response_cache import SUBMIT_SCRIPT, submit_call
from sluice.samples import Sample, read_samples
from sluice.streams import CANCEL_SCRIPT, ENQUEUE_SCRIPT, WITHDRAW_SCRIPT, enqueue_call, enqueue_verdict


class Broker:
    """Submit, read, cancel and announce jobs; one instance per process over a shared client."""

    def __init__(self, *, redis: aioredis.Redis, result_ttl_s: int, idempotency_ttl_s: int = 86_400,
                 idempotency_lease_s: float = LEASE_S, durable_timeout_ms: int | None = None) -> None:
        self.redis = redis
        self.result_ttl_s = result_ttl_s
        self.idempotency_ttl_s = idempotency_ttl_s
        self.idempotency_lease_s = idempotency_lease_s
        # Set: durable accept (sluice.durability), waiting up to this long for the fsync.
        self.durable_timeout_ms = durable_timeout_ms
        self._cancel = redis.register_script(CANCEL_SCRIPT)
        self._enqueue = redis.register_script(ENQUEUE_SCRIPT)
        self._release = redis.register_script(RELEASE_SCRIPT)
        self._submit = redis.register_script(SUBMIT_SCRIPT)
        self._withdraw = redis.register_script(WITHDRAW_SCRIPT)

    async def enqueue(self, records: Sequence[JobRecord], *, limits: TenantLimits,
                      idempotency: IdempotencyClaim | None = None) -> Refusal | None:
        """Queue one submission's jobs (records and stream entries) if the tenant's quota and rate
        allow, charging both and completing the Idempotency-Key in the same atomic script; answer
        the refusal otherwise, with nothing written. See `streams.ENQUEUE_SCRIPT`. Jobs answered from
        the response cache (`cache_hit`, in input order among the others) are written final in the
        same step, and only if the rest pass; they take no quota place and no rate token
        (`response_cache.SUBMIT_SCRIPT`).

        In durable mode the same round trip waits for the fsync; unconfirmed, the queued jobs are
        withdrawn and NotDurable (503) raised.
        """
        queued = [record for record in records if not record.cache_hit]
        script, call = (self._enqueue, enqueue_call) if len(queued) == len(records) else (self._submit, submit_call)
        script_keys, args = call(records, limits=limits, now=time.time(), result_ttl_s=self.result_ttl_s,
                                 idempotency=idempotency, idempotency_ttl_s=self.idempotency_ttl_s)
        with translate_redis_errors():
            if self.durable_timeout_ms is None:
                reply, fsync = await script(keys=script_keys, args=args), None
            else:
                # A context: loading the script can fail before execute() would release the connection.
                async with self.redis.pipeline(transaction=False) as pipe:
                    await script(keys=script_keys, args=args, client=pipe)
                    wait_fsynced(pipe, self.durable_timeout_ms)
                    reply, fsync = await pipe.execute(raise_on_error=False)
                if isinstance(reply, Exception):
                    raise reply
        verdict, value = enqueue_verdict(reply)
        if verdict == "lost":
            raise Conflict("this request held its Idempotency-Key too long and another request took it; "
                           "retry to get that request's answer", headers={"Retry-After": "1"})
        if verdict == "ok":
            if self.durable_timeout_ms is not None and not fsynced(fsync):
                await self._withdraw_unconfirmed(queued, [r.id for r in records], limits.tenant, idempotency, fsync)
            return None
        return Refusal(verdict, queued=int(value)) if verdict == "quota" else Refusal(verdict, wait_s=value)

    async def _withdraw_unconfirmed(self, records: Sequence[JobRecord], answers: list[str], tenant: str,
                                    idempotency: IdempotencyClaim | None, reply: object) -> None:
        """Undo the queueing of jobs whose fsync was not confirmed, so a 503 leaves nothing behind.

        A job a worker took in the meantime cannot be withdrawn: it runs, and a client that
        submits again may have it run twice (at least once, as everywhere else); with an
        Idempotency-Key and every job started, a retry replays them instead. Cache hits (in
        `answers`, the ids the key replays, not in `records`) are final already and stay.
        """
        script_keys, completed = [keys.queued_jobs(tenant)], ""
        if idempotency is not None:
            script_keys.append(idempotency.redis_key)
            completed = idempotency.completed(answers)
        script_keys += [keys.job(r.id) for r in records]
        with translate_redis_errors():
            started = int(await self._withdraw(keys=script_keys, args=[completed]))
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

    async def scaling_decisions(self, versions: list[tuple[str, str]]) -> dict[tuple[str, str], dict[str, Any]]:
        """The scheduler's last decision per (model, version) (`scheduler/scaling.py` writes them),
        where one was made in the last minute: `{"desired", "live", "reason"}`. One round trip."""
        with translate_redis_errors():
            pipe = self.redis.pipeline(transaction=False)
            for model, version in versions:
                pipe.hgetall(keys.replicas(model, version))
            replies = await pipe.execute()
        decisions = {}
        for key, raw in zip(versions, replies, strict=True):
            if raw:
                data = {k.decode(): v.decode() for k, v in raw.items()}
                decisions[key] = {"desired": int(data["desired"]), "live": int(data["live"]),
                                  "reason": data["reason"]}
        return decisions

    async def cancel(self, job_id: str, tenant: str) -> str | None:
        """Cancel a queued job; answer None when done, else the state that prevents it."""
        with translate_redis_errors():
            outcome = await self._cancel(keys=[keys.job(job_id), keys.queued_jobs(tenant), keys.WEBHOOK_OUTBOX],
                                         args=[repr(time.time())])
        state = outcome.decode() if isinstance(outcome, bytes) else str(outcome)
        if state != "ok":
            return state
        await self.publish(events.JobChanged(id=job_id, status=JobStatus.cancelled))
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
