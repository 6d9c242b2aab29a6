"""Whose work goes next inside one version's lane: deficit round robin between tenants, and
priority with ageing between a tenant's jobs. Pure: values and a clock reading in, decisions out,
so the worker, the release of held jobs and the simulator run the same rules
(docs/ARCHITECTURE.md, "Priority and fair sharing").

Deficit round robin (Shreedhar and Varghese) on a measured amount: each tenant with work ready
takes turns; a turn starts by crediting the tenant `quantum * share`; the tenant is served while
its credit is above zero, and each service is charged afterwards, at what it really cost (model
seconds for a batch, tokens for a job released into the stream). A tenant with no work ready
leaves the ring and forfeits its credit, so time spent idle buys no burst later. The guarantee: a
tenant that becomes ready waits for at most one turn of every other ready tenant (a quantum of
theirs, plus the one service that overdraws it), however deep their backlogs.

Priority (0 first, 1 by default, 2 last) orders the classes: the most urgent class with work is
served first, fairly between its tenants. A job whose wait has reached `ageing_s` counts as the
most urgent priority with work, and goes ahead of its tenant's jobs native to that priority, so no
flood of urgent work, however old, holds a job back much past that bound. Among jobs of one
priority ageing changes nothing: a flood's old jobs do not outrank another tenant's new ones, turns
decide.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

DEFAULT_PRIORITY = 1
DEFAULT_SHARE = 1.0
# A job waiting this long counts as the most urgent priority with work (the bound stated in
# docs/ARCHITECTURE.md).
DEFAULT_AGEING_S = 10.0

T = TypeVar("T", bound=Hashable)


def effective_priority(priority: int, *, waited_s: float, ageing_s: float, most_urgent: int) -> int:
    """`priority`, or the `most_urgent` priority with work once the job has waited `ageing_s`."""
    return min(priority, most_urgent) if waited_s >= ageing_s else priority


class DeficitRoundRobin(Generic[T]):
    """The turn-taking state of one lane's tenants. `quantum`: the credit of one turn at share 1,
    in the unit of `charge` (a batch's model seconds, or a job's tokens)."""

    def __init__(self, *, quantum: float, shares: Mapping[T, float] | None = None,
                 default_share: float = DEFAULT_SHARE) -> None:
        if quantum <= 0:
            raise ValueError(f"quantum must be positive, got {quantum}")
        self.quantum = quantum
        self.default_share = default_share
        self._shares: dict[T, float] = dict(shares or {})
        self._ring: deque[T] = deque()
        self._credit: dict[T, float] = {}

    def note_share(self, tenant: T, share: float) -> None:
        """`tenant`'s weight, as its latest job carried it."""
        if share > 0:
            self._shares[tenant] = share

    def share(self, tenant: T) -> float:
        return self._shares.get(tenant, self.default_share)

    def pick(self, ready: Collection[T]) -> T | None:
        """The tenant to serve now among those with work `ready`, or None when there are none."""
        if not ready:
            return None
        for tenant in [t for t in self._ring if t not in ready]:
            self._ring.remove(tenant)
            del self._credit[tenant]
        for tenant in ready:
            if tenant not in self._credit:
                self._ring.append(tenant)
                self._credit[tenant] = 0.0
        # Every pass round the ring credits each tenant once, and a charge overdraws by one
        # service at most, so this ends within a few rounds; the skip below makes it one when
        # every credit is deeply overdrawn (a long batch against a small quantum).
        lowest = min(self._credit[t] / self.share(t) for t in self._ring)
        if lowest < -self.quantum:
            rounds = int(-lowest // self.quantum)
            for tenant in self._ring:
                self._credit[tenant] += rounds * self.quantum * self.share(tenant)
        while self._credit[self._ring[0]] <= 0:
            self._ring.rotate(-1)
            head = self._ring[0]
            self._credit[head] += self.quantum * self.share(head)
        return self._ring[0]

    def charge(self, tenant: T, amount: float) -> None:
        """What serving `tenant` cost, once known."""
        if tenant in self._credit:
            self._credit[tenant] -= amount


class Contention:
    """Whether tenants contend for a lane now, and which of them take more than their share.

    Tenants contend while more than one has had work in the lane within `window_s`. A contending
    tenant whose recent model time (decayed with half-life `window_s`) is over its share of the
    contenders' gets its batches kept to `slice_limit` items: its batch on the model then holds
    another tenant's next job back by about one slice, not a full batch, and a light tenant's
    batches, which keep it within its share, stay whole."""

    def __init__(self, *, window_s: float = 1.0, share: Callable[[str], float] = lambda _: DEFAULT_SHARE) -> None:
        self.window_s = window_s
        self.share = share
        self._seen: dict[str, float] = {}
        self._used: dict[str, tuple[float, float]] = {}  # tenant -> (decayed model seconds, as of)

    def saw(self, tenant: str, now: float) -> None:
        self._seen[tenant] = now

    def used(self, tenant: str, model_s: float, now: float) -> None:
        self._used[tenant] = (self._usage(tenant, now) + model_s, now)

    def _usage(self, tenant: str, now: float) -> float:
        amount, at = self._used.get(tenant, (0.0, now))
        return float(amount * 0.5 ** (max(0.0, now - at) / self.window_s))

    def contenders(self, now: float) -> list[str]:
        for tenant in [t for t, at in self._seen.items() if now - at > self.window_s]:
            del self._seen[tenant]
            self._used.pop(tenant, None)
        return list(self._seen)

    def over_share(self, now: float) -> set[str]:
        """The contending tenants that have lately used more than their share (none while fewer
        than two contend)."""
        contenders = self.contenders(now)
        if len(contenders) < 2:
            return set()
        usage = {t: self._usage(t, now) for t in contenders}
        total = sum(usage.values())
        weights = sum(self.share(t) for t in contenders)
        if total <= 0:
            return set()
        return {t for t in contenders if usage[t] / total > self.share(t) / weights}


def model_quantum(slice_s: float) -> float:
    """A tenant's turn on the model at share 1, in model seconds: a quarter of a slice. A heavy
    tenant's sliced batch, which fills most of a slice, overdraws it, so tenants alternate batch
    by batch and shares weigh in as overdrafts are paid back. Floored for a version with no
    batching window."""
    return max(0.001, slice_s / 4)


def slice_limit(*, items_per_s: float, slice_s: float) -> int | None:
    """How many items run in `slice_s` model seconds at the measured rate; None before a rate is
    measured."""
    if items_per_s <= 0 or slice_s <= 0:
        return None
    return max(1, math.floor(items_per_s * slice_s))


def batch_limit(contention: Contention, *, items_per_s: float, slice_s: float,
                now: float) -> Callable[[str], int | None] | None:
    """While tenants contend, each one's batch size (`MicroBatcher.take`'s `limit`): a slice's worth
    of items for one over its share, a whole batch for the others; None while none contend."""
    if len(contention.contenders(now)) < 2:
        return None
    sliced = slice_limit(items_per_s=items_per_s, slice_s=slice_s)
    if sliced is None:
        return None
    # Read once per take, not once per group the batcher looks at.
    heavy = contention.over_share(now)
    return lambda tenant: sliced if tenant in heavy else None


@dataclass(frozen=True, slots=True)
class HeldQueue:
    """One tenant's held jobs of one priority, as the release sees them: how many, how long the
    first has waited and what it costs (the estimate for the jobs behind it)."""

    priority: int
    tenant: str
    count: int
    head_enqueued_at: float
    head_cost: int
    share: float = DEFAULT_SHARE


def plan_release(queues: Sequence[HeldQueue], *, want: int, now: float, turns: DeficitRoundRobin[str],
                 ageing_s: float) -> list[tuple[HeldQueue, int]]:
    """Which held jobs to release into the stream, `want` at most, in order: the most urgent
    priority first (ageing applied to each queue's first job), tenants in turn within it, each
    job charged its queue's first job's cost. Consecutive jobs of one queue are merged."""
    left = {(q.priority, q.tenant): q.count for q in queues if q.count > 0}
    by_key = {(q.priority, q.tenant): q for q in queues}
    for queue in queues:
        turns.note_share(queue.tenant, queue.share)
    plan: list[tuple[HeldQueue, int]] = []
    for _ in range(want):
        if not left:
            break
        most_urgent = min(key[0] for key in left)
        classes = {key: effective_priority(key[0], waited_s=now - by_key[key].head_enqueued_at, ageing_s=ageing_s,
                                           most_urgent=most_urgent)
                   for key in left}
        urgent = min(classes.values())
        candidates = sorted(key for key, cls in classes.items() if cls == urgent)
        tenant = turns.pick({key[1] for key in candidates})
        # Of the tenant's queues in the class, one aged into it first, else the longest waiting.
        key = min((key for key in candidates if key[1] == tenant),
                  key=lambda k: (k[0] == urgent, by_key[k].head_enqueued_at))
        queue = by_key[key]
        turns.charge(queue.tenant, max(1, queue.head_cost))
        if plan and plan[-1][0] is queue:
            plan[-1] = (queue, plan[-1][1] + 1)
        else:
            plan.append((queue, 1))
        left[key] -= 1
        if not left[key]:
            del left[key]
    return plan
