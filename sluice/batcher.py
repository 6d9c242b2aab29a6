"""Length-aware micro-batcher shared by the inference worker and the simulator.

A worker pulls requests off the stream one by one but the model wants them in
batches: big enough to use the accelerator, small enough that nobody waits more
than ``max_wait_ms``, and made of inputs of similar length so that a short input
does not pay for a long one's padding. This module decides *which* items go
together and *when* a batch closes; it never sleeps, reads a clock or touches
I/O. The caller passes ``now`` (seconds, same clock as ``Item.enqueued_at``), so
the exact same code runs in the asyncio worker and in a discrete-event
simulator, and tests can assert exact deadlines.

Items are grouped by ``(priority, job priority, tenant, length bucket)``
(tenant is ``None`` when tenants are not isolated). A group closes

* by **size** as soon as it holds ``max_batch_size`` items,
* by **age** when its oldest item has waited ``max_wait_ms`` (with ``adaptive_wait``, only as
  much of it as another arrival of its lane is expected within: sluice/batch_window.py),
* by **drain** when the caller shuts down.

Two ways to drive it:

* ``take(now)`` whenever the model is free: the one most urgent batch ready at
  ``now``, or ``None`` (then wait for ``next_deadline()`` or the next ``add``).
  While any item of a more urgent ``priority`` is held (the online lane: 0),
  ``take`` and ``next_deadline`` see only those: bulk items (1) run when no
  online item is held, however overdue they are, and never share its batches.
  Everything else stays held and keeps growing while the model runs. This is
  what the worker does: with a backlog every item is overdue the moment it is
  read, and closing groups as they are read would ship them one or two at a
  time; taken when the model is free they are as full as the held items allow.
  Within the lane, ``take`` serves the most urgent *job* priority (0-2) among
  the ready groups, a group whose oldest item has waited ``ageing_s`` counting
  as the most urgent one ready; within that, the tenant whose turn it is (``turns``, deficit
  round robin on model time, sluice/fair_share.py), then the oldest group.
  Without tenant isolation a batch is filled fairly: the tenants of a group
  take places in turn, in proportion to their shares.
* ``poll(now)`` closes *every* ready group at once (eager; the simulator and
  the backlog replay compare it with ``take``).

The surprising parts:

* The default bucket bounds are fine (a factor of 2**(1/6), about 12 %, from
  one bound to the next): with a backlog held, a batch pads like a length-sorted
  one (measured with MiniLM: 1.06-1.09 padded tokens per real token, against
  1.3-1.8 with power-of-two buckets), at the price of smaller batches (a mean of
  11 with 128 items held). That costs little where per-token cost dominates (one
  CPU thread); where a forward pass has a large fixed cost, ``top_up`` or
  coarser ``bucket_bounds`` trade padding back for size.
* When an age close would ship a partial batch, it can be topped up with the
  oldest items of the *shorter* buckets of the same tenant group. Those items
  pay padding up to the closing bucket's bound; in exchange they ride a forward
  pass that would otherwise run part empty, and leave before their own
  deadline. Items of *longer* buckets are never pulled in: one long
  item would multiply the padded cost of every short item in the batch. So a
  batch's ``bucket`` is the bucket of its longest item, and every item in it has
  ``cost <= bucket_bounds[bucket]``. This is a trade, not a free win: it saves
  forward passes and costs padded tokens, so it pays where a forward pass has a
  large fixed cost (an accelerator) and loses where cost is per token (one CPU
  thread: with a backlog it raised padding 1.3-2.4x). ``top_up=False`` turns it off.
* Size-ready batches are only handed out by ``poll``/``take`` (whatever ``now``
  is), not by ``add``, and ``next_deadline`` reports age deadlines only. Callers
  must therefore ``take``/``poll`` after ``add``; in exchange ``remove`` can
  still cancel an item that filled a group, since nothing has been handed out yet.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, cast

from typing_extensions import TypeVar

from sluice.batch_window import ArrivalGaps, waited_window_s
from sluice.fair_share import DEFAULT_AGEING_S, DEFAULT_PRIORITY, DeficitRoundRobin, effective_priority
from sluice.vocabulary import CloseReason

__all__ = ["DEFAULT_BUCKET_BOUNDS", "Batch", "CloseReason", "Item", "MicroBatcher"]

# 8 .. 4096 in steps of 2**(1/6): 55 bounds, about 12 % apart. Costs above the last bound share
# the overflow bucket.
DEFAULT_BUCKET_BOUNDS: tuple[int, ...] = tuple(sorted({round(8 * 2 ** (k / 6)) for k in range(55)}))

# What an item carries. It defaults to Any (PEP 696), so a bare `Item`, `Batch` or `MicroBatcher`
# still means "any payload" and `Item(..., payload=Delivery(...))` infers `Item[Delivery]`.
P = TypeVar("P", default=Any)


@dataclass(frozen=True, slots=True)
class Item(Generic[P]):
    """One request as the batcher sees it; ``payload`` is carried, never read."""

    id: str
    tenant: str
    cost: int
    enqueued_at: float
    # Lower is more urgent: 0 for the online lane, 1 for bulk.
    priority: int = 0
    # The job's own priority within its lane (0 first; sluice/fair_share.py).
    job_priority: int = DEFAULT_PRIORITY
    # Payloads can be large tensors or bytes: keep them out of == and of logs.
    # An item built without one carries None (the cast: a default cannot be typed as P).
    payload: P = field(default=cast(P, None), compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Batch(Generic[P]):
    """A closed batch, items oldest first."""

    items: tuple[Item[P], ...]
    close_reason: CloseReason
    bucket: int
    tenant: str | None
    closed_at: float

    def __post_init__(self) -> None:
        if not self.items:
            raise ValueError("a batch holds at least one item")

    @property
    def oldest_enqueued_at(self) -> float:
        return min(item.enqueued_at for item in self.items)

    @property
    def max_cost(self) -> int:
        return max(item.cost for item in self.items)


# (priority, job priority, tenant): items of different priorities never share a group, so never a batch.
_TenantKey = tuple[int, int, str | None]
# The sequence number breaks enqueued_at ties in add order, so the tuples sort
# by arrival and Item itself (which has no ordering) is never compared.
_Entry = tuple[float, int, Item[P]]


class MicroBatcher(Generic[P]):
    """Groups items by tenant and length bucket and closes batches by size or age.

    See the module docstring for the rules. All methods are pure bookkeeping;
    ``take``, ``poll`` and ``next_deadline`` cost O(groups) plus the items they
    hand out.
    """

    __slots__ = (
        "_ageing_s",
        "_bounds",
        "_gaps",
        "_groups",
        "_isolate",
        "_max_batch_size",
        "_max_wait_s",
        "_next_seq",
        "_top_up_enabled",
        "_turns",
        "_waits",
        "_where",
    )

    def __init__(
        self,
        *,
        max_batch_size: int,
        max_wait_ms: float,
        isolate_tenants: bool = True,
        bucket_bounds: Sequence[int] = DEFAULT_BUCKET_BOUNDS,
        top_up: bool = True,
        ageing_s: float = DEFAULT_AGEING_S,
        turns: DeficitRoundRobin[str] | None = None,
        adaptive_wait: bool = False,
    ) -> None:
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int):
            raise ValueError(f"max_batch_size must be an int, got {max_batch_size!r}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if not math.isfinite(max_wait_ms) or max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be finite and >= 0, got {max_wait_ms}")
        bounds = tuple(bucket_bounds)
        for bound in bounds:
            if isinstance(bound, bool) or not isinstance(bound, int) or bound <= 0:
                raise ValueError(f"bucket_bounds must be positive ints, got {bounds}")
        if any(lo >= hi for lo, hi in zip(bounds, bounds[1:], strict=False)):
            raise ValueError(f"bucket_bounds must be strictly increasing, got {bounds}")

        self._max_batch_size = max_batch_size
        # Computed once: every deadline is enqueued_at + this exact float, so a
        # caller polling at next_deadline() compares equal, never a ulp short.
        self._max_wait_s = max_wait_ms / 1000
        self._isolate = isolate_tenants
        self._bounds = bounds
        self._top_up_enabled = top_up
        self._ageing_s = ageing_s
        # The lane's tenants' turns (charged by the caller with each batch's model time); None:
        # the oldest ready group goes first, whoever's it is.
        self._turns = turns
        # tenant -> bucket -> entries sorted by (enqueued_at, seq). Nested by
        # tenant so a top-up only looks at that tenant's few buckets. Empty
        # groups are deleted so per-call scans stay proportional to live groups.
        self._groups: dict[_TenantKey, dict[int, list[_Entry[P]]]] = {}
        self._where: dict[str, tuple[_TenantKey, int]] = {}
        self._next_seq = 0
        # Per priority (lane): its arrivals' gaps and the window they leave (sluice/batch_window.py).
        self._gaps: dict[int, ArrivalGaps] | None = {} if adaptive_wait else None
        self._waits: dict[int, float] = {}

    @property
    def max_batch_size(self) -> int:
        return self._max_batch_size

    @property
    def bucket_bounds(self) -> tuple[int, ...]:
        return self._bounds

    def bucket_of(self, cost: int) -> int:
        """Index of the first bound >= cost, or len(bucket_bounds) for overflow."""
        return bisect_left(self._bounds, cost)

    def window_s(self, priority: int) -> float:
        """How long a batch of this priority (lane) waits for more items now: ``max_wait_ms``, or
        with ``adaptive_wait`` what the lane's arrival gap leaves of it."""
        return self._waits.get(priority, self._max_wait_s)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, item_id: object) -> bool:
        return item_id in self._where

    def add(self, item: Item[P]) -> None:
        # A duplicate id would make remove() ambiguous; a redelivered stream
        # entry that is still held must be skipped by the caller (see `in`).
        if item.id in self._where:
            raise ValueError(f"item {item.id!r} is already held")
        if item.cost < 0:
            raise ValueError(f"item {item.id!r} has negative cost {item.cost}")
        if not math.isfinite(item.enqueued_at):
            raise ValueError(f"item {item.id!r} has non-finite enqueued_at")
        tenant = (item.priority, item.job_priority, item.tenant if self._isolate else None)
        bucket = self.bucket_of(item.cost)
        entry: _Entry[P] = (item.enqueued_at, self._next_seq, item)
        self._next_seq += 1
        group = self._groups.setdefault(tenant, {}).setdefault(bucket, [])
        # Arrivals are nearly in order, so this is almost always an append.
        insort(group, entry)
        self._where[item.id] = (tenant, bucket)
        if self._gaps is not None:
            gaps = self._gaps.setdefault(item.priority, ArrivalGaps())
            gaps.add(item.enqueued_at)
            self._waits[item.priority] = waited_window_s(self._max_wait_s, gaps.mean_gap_s())

    def poll(self, now: float) -> list[Batch[P]]:
        """Close every batch that is ready at ``now``, most urgent first."""
        batches: list[Batch[P]] = []
        # Size closes first: afterwards every group fits in one batch, so an
        # age close below takes its whole group and nothing overdue is left.
        for tenant, buckets in list(self._groups.items()):
            for bucket, group in list(buckets.items()):
                while len(group) >= self._max_batch_size:
                    batches.append(self._close(tenant, bucket, "size", now))
        # Lanes may wait windows of their own, so the oldest group is not always the first due.
        while ready := [(group[0][:2], tenant, bucket) for tenant, buckets in self._groups.items()
                        for bucket, group in buckets.items() if group[0][0] + self.window_s(tenant[0]) <= now]:
            _, tenant, bucket = min(ready)
            batches.append(self._close(tenant, bucket, "age", now))
        batches.sort(key=lambda b: b.oldest_enqueued_at)
        return batches

    def take(self, now: float, *, max_priority: int | None = None,
             limit: Callable[[str], int | None] | None = None) -> Batch[P] | None:
        """The most urgent batch ready at ``now`` (by size or age), or None.

        Most urgent = of the most urgent lane held, the ready groups of the most
        urgent job priority (after ageing), of the tenant whose turn it is, the
        one whose oldest item is oldest; a group that is both full and overdue
        closes by size, as in ``poll``. Call it when the model is free.
        ``max_priority``: None unless a batch of at most this priority is ready.
        ``limit``: while tenants contend (given only then), the most items a batch of a tenant's
        may hold, or None: a heavy tenant's batch is kept short so that another's waits little
        behind it, a tenant with no limit goes first, and every group is ready at once, since
        the model that frees has just run another tenant's batch and no window would fill it
        further.
        """
        urgent = self._urgent_priority()
        if urgent is None or (max_priority is not None and urgent > max_priority):
            return None
        ready: list[tuple[int, tuple[float, int], _TenantKey, int, CloseReason, int]] = []
        for tenant, buckets in self._groups.items():
            if tenant[0] != urgent:
                continue
            size = self._max_batch_size
            if limit is not None and tenant[2] is not None:
                size = max(1, min(limit(tenant[2]) or size, size))
            for bucket, group in buckets.items():
                head = group[0]
                if len(group) >= size:
                    reason: CloseReason = "size"
                elif head[0] + self.window_s(tenant[0]) <= now or limit is not None:
                    reason = "age"
                else:
                    continue
                ready.append((tenant[1], head[:2], tenant, bucket, reason, size))
        if not ready:
            return None
        most_urgent = min(each[0] for each in ready)
        ready = [(effective_priority(each[0], waited_s=now - each[1][0], ageing_s=self._ageing_s,
                                     most_urgent=most_urgent), *each[1:]) for each in ready]
        level = min(each[0] for each in ready)
        ready = [each for each in ready if each[0] == level]
        if self._turns is not None and self._isolate:
            tenants = {cast(str, each[2][2]) for each in ready}
            if limit is not None:
                # A tenant within its share goes before one over it: its short wait is what
                # fairness buys it, and more of its work would put it over its share.
                tenants = {tenant for tenant in tenants if limit(tenant) is None} or tenants
            whose = self._turns.pick(tenants)
            ready = [each for each in ready if each[2][2] == whose]
        # A group aged into the level goes ahead of the ones native to it, then the oldest.
        _, _, tenant, bucket, reason, size = min(ready, key=lambda each: (each[2][1] == level, each[1]))
        return self._close(tenant, bucket, reason, now, size=size)

    def next_deadline(self) -> float | None:
        """Earliest age deadline among held items, or None when empty.

        Size-ready groups are not reflected here: poll() after add() for those.
        Only the most urgent priority held counts, as in ``take``.
        """
        key = self._oldest_group(self._urgent_priority())
        if key is None:
            return None
        tenant, bucket = key
        return self._groups[tenant][bucket][0][0] + self.window_s(tenant[0])

    def drain(self, now: float) -> list[Batch[P]]:
        """Close everything held, oldest first, with the same top-up rule."""
        batches: list[Batch[P]] = []
        while (key := self._oldest_group()) is not None:
            batches.append(self._close(key[0], key[1], "drain", now))
        batches.sort(key=lambda b: b.oldest_enqueued_at)
        return batches

    def remove(self, ids: Collection[str]) -> list[Item[P]]:
        """Drop held items (e.g. cancelled); unknown ids are ignored.

        Unknown ids are expected: a cancel can race with the batch closing.
        Returns the removed items oldest first.
        """
        if isinstance(ids, str):
            # A str is a Collection[str]; iterating it would remove by character.
            raise TypeError("remove() takes a collection of ids, not a single str")
        doomed: dict[tuple[_TenantKey, int], set[str]] = {}
        for item_id in ids:
            key = self._where.pop(item_id, None)
            if key is not None:
                doomed.setdefault(key, set()).add(item_id)
        removed: list[_Entry[P]] = []
        for (tenant, bucket), group_ids in doomed.items():
            buckets = self._groups[tenant]
            kept: list[_Entry[P]] = []
            for entry in buckets[bucket]:
                (removed if entry[2].id in group_ids else kept).append(entry)
            if kept:
                buckets[bucket] = kept
            else:
                self._drop_group(tenant, bucket)
        removed.sort()
        return [entry[2] for entry in removed]

    def _urgent_priority(self) -> int | None:
        return min((tenant[0] for tenant in self._groups), default=None)

    def _oldest_group(self, priority: int | None = None) -> tuple[_TenantKey, int] | None:
        """The group whose oldest item is oldest (among groups of `priority`, when given)."""
        best: tuple[_TenantKey, int] | None = None
        best_head: tuple[float, int] | None = None
        for tenant, buckets in self._groups.items():
            if priority is not None and tenant[0] != priority:
                continue
            for bucket, group in buckets.items():
                head = (group[0][0], group[0][1])
                if best_head is None or head < best_head:
                    best, best_head = (tenant, bucket), head
        return best

    def _close(
        self, tenant: _TenantKey, bucket: int, reason: CloseReason, now: float, *, size: int | None = None
    ) -> Batch[P]:
        size = size or self._max_batch_size
        group = self._groups[tenant][bucket]
        if tenant[2] is None and self._turns is not None and len(group) > size:
            ordered = self._fair_order(group)
            taken = ordered[:size]
            group[:] = sorted(ordered[size:])
        else:
            taken = group[:size]
            del group[:size]
        if not group:
            self._drop_group(tenant, bucket)
        room = size - len(taken)
        if room and self._top_up_enabled:
            taken.extend(self._top_up(tenant, bucket, room))
        taken.sort()
        for entry in taken:
            del self._where[entry[2].id]
        return Batch(
            items=tuple(entry[2] for entry in taken),
            close_reason=reason,
            bucket=bucket,
            tenant=tenant[2],
            closed_at=now,
        )

    def _fair_order(self, group: list[_Entry[P]]) -> list[_Entry[P]]:
        """A mixed-tenant group in the order its places are filled: the k-th oldest item of a
        tenant at k / share, so each tenant fills places in proportion to its share."""
        assert self._turns is not None
        seen: dict[str, int] = {}
        keyed = []
        for entry in group:
            tenant = entry[2].tenant
            rank = seen[tenant] = seen.get(tenant, 0) + 1
            keyed.append(((rank / self._turns.share(tenant), entry[:2]), entry))
        keyed.sort(key=lambda pair: pair[0])
        return [entry for _, entry in keyed]

    def _top_up(self, tenant: _TenantKey, bucket: int, room: int) -> list[_Entry[P]]:
        """Take up to ``room`` oldest items from this tenant's shorter buckets."""
        buckets = self._groups.get(tenant)
        if not buckets:
            return []
        # Buckets are disjoint cost ranges, so "cost <= this bucket's bound" is
        # exactly "bucket index below this one".
        donors = [(b, group) for b, group in buckets.items() if b < bucket]
        taken: list[_Entry[P]] = []
        while donors and len(taken) < room:
            i = min(range(len(donors)), key=lambda j: donors[j][1][0][:2])
            donor_bucket, group = donors[i]
            taken.append(group.pop(0))
            if not group:
                self._drop_group(tenant, donor_bucket)
                donors.pop(i)
        return taken

    def _drop_group(self, tenant: _TenantKey, bucket: int) -> None:
        buckets = self._groups[tenant]
        del buckets[bucket]
        if not buckets:
            del self._groups[tenant]
