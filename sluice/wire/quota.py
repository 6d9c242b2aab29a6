"""A tenant's admission records in Redis: its rate bucket (`keys.rate_bucket`), its queued jobs
(`keys.queued_jobs`) and its stored answered jobs (`keys.answered_jobs`), with the arguments of
the script that checks and charges them (sluice/wire/lua/admit.lua).

All, and the tenant's Idempotency-Keys, carry the tag `{tenant}`: one slot. A submission is
checked and charged there in one atomic step before its jobs are written (in their version's slot,
by queue.lua): concurrent submissions cannot all pass a quota they each read before any of them was
counted, and a refused submission takes no rate tokens.

The surprising part: the quota is a sorted set of job ids, not a counter. A member's score is
when its place frees on its own: the job's deadline, or the expiry of its record if that comes
first. The script drops members past their score before counting; the process that moves a job
out of `queued` (a worker's claim, a cancel) removes its member just after (`streams.free_places`).
So a place whose job never leaves `queued`, or whose remover died, or whose submission died before
its jobs were written, is held no longer than the job's record would live, and nothing leaks.
The answered set is alike: the jobs answered from the response cache, each scored by when its
record expires, so that it bounds the records of such jobs Redis holds for the tenant.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from sluice.wire import keys
from sluice.wire.jobs import JobRecord

Verdict = Literal["ok", "lost", "quota", "stored", "rate"]


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """`max_answered`: the jobs answered from the response cache whose records the tenant may have
    stored at once; `hit_cost`: the rate tokens such a job spends (a queued job spends one)."""

    tenant: str
    rate_per_s: float
    burst: int
    max_queued: int
    max_answered: int
    hit_cost: float = 1.0


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why the enqueue script queued nothing: the tenant's quota (with `queued` jobs already), its
    bound on stored answered jobs (`stored`, with `wait_s` until enough of them expire, or -1 when
    the submission alone has more), or its rate limit (with `wait_s` until the tokens are there)."""

    reason: Literal["quota", "stored", "rate"]
    queued: int = 0
    wait_s: float = 0.0


def frees_at(record: JobRecord, *, result_ttl_s: int) -> float:
    """When the job's place in the quota frees if it never leaves `queued`: past its deadline it
    can only expire, and past its record's TTL there is nothing left to run."""
    expiry = record.enqueued_at + result_ttl_s
    return expiry if record.deadline is None else min(record.deadline, expiry)


def token_cost(records: Sequence[JobRecord], *, hit_cost: float) -> float:
    """The rate tokens a submission spends: one per job to queue, `hit_cost` per job answered from
    the response cache."""
    hits = sum(1 for record in records if record.cache_hit)
    return (len(records) - hits) + hits * hit_cost


def admit_call(records: Sequence[JobRecord], *, limits: TenantLimits, now: float, result_ttl_s: int,
               marker: str | None, redis_key: str | None, lease_s: float) -> tuple[list[str], list[str]]:
    """KEYS and ARGV of admit.lua for the jobs of one submission, queued and answered alike."""
    script_keys = [keys.queued_jobs(limits.tenant), keys.rate_bucket(limits.tenant),
                   keys.answered_jobs(limits.tenant)]
    args = [repr(now), str(limits.max_queued), repr(limits.rate_per_s), str(limits.burst), str(result_ttl_s)]
    if marker is None or redis_key is None:
        args += ["", "0"]
    else:
        script_keys.append(redis_key)
        args += [marker, str(max(1, int(lease_s * 1000)))]
    queued = [record for record in records if not record.cache_hit]
    args += [str(limits.max_answered), repr(token_cost(records, hit_cost=limits.hit_cost)), str(len(queued))]
    for record in queued:
        args += [record.id, repr(frees_at(record, result_ttl_s=result_ttl_s))]
    for record in records:
        if record.cache_hit:
            args += [record.id, repr(record.enqueued_at + result_ttl_s)]
    return script_keys, args


def verdict(reply: list[Any]) -> tuple[Verdict, float]:
    """admit.lua's verdict, with the tenant's queued jobs (`quota`), or the seconds until its
    stored answers have room (`stored`) or its tokens are there (`rate`)."""
    name = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
    value = reply[1] if len(reply) > 1 else 0
    return cast(Verdict, name), float(value.decode() if isinstance(value, bytes) else value)
