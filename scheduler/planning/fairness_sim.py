"""Tenants sharing one version's worker, simulated: a flood from one tenant and a trickle from
another through the real `sluice.batcher.MicroBatcher` and `sluice.fair_share` turns, on a
synthetic clock. It answers what the fairness bench (bench/fairness.py) measures on real
processes, in milliseconds of CPU: the trickle's queue-wait percentiles with the flood there or
not, with fair sharing on or off (docs/ARCHITECTURE.md, "Priority and fair sharing").
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from scheduler.planning.capacity_sim import CostModel
from sluice.batcher import Item, MicroBatcher
from sluice.fair_share import Contention, DeficitRoundRobin, batch_limit, model_quantum


@dataclass(frozen=True, slots=True)
class FairnessRun:
    flood_jobs: int = 20_000
    trickle_share_of_capacity: float = 0.2
    trickle_jobs: int = 400
    tokens: int = 16
    max_batch_size: int = 32
    max_wait_ms: float = 10.0
    fair: bool = True
    flood: bool = True
    seed: int = 0


@dataclass(frozen=True, slots=True)
class FairnessResult:
    trickle_wait_p50_ms: float
    trickle_wait_p99_ms: float
    flood_done: int


def simulate_fairness(run: FairnessRun, *, cost: CostModel | None = None) -> FairnessResult:
    """One worker, one lane: the flood's jobs all arrive at 0, the trickle's one by one at the given
    share of the worker's capacity (full batches), Poisson. Answers the trickle's queue wait."""
    cost = cost or CostModel()
    capacity = run.max_batch_size / cost.batch_s(run.max_batch_size, run.tokens)  # jobs a second
    rate = run.trickle_share_of_capacity * capacity
    rng = np.random.default_rng(run.seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=run.trickle_jobs)) + 0.5
    turns: DeficitRoundRobin[str] | None = DeficitRoundRobin(
        quantum=model_quantum(run.max_wait_ms / 1000)) if run.fair else None
    batcher: MicroBatcher[None] = MicroBatcher(max_batch_size=run.max_batch_size, max_wait_ms=run.max_wait_ms,
                                               bucket_bounds=(), turns=turns)
    if run.flood:
        for i in range(run.flood_jobs):
            batcher.add(Item(id=f"a{i}", tenant="a", cost=run.tokens, enqueued_at=0.0))
    events: list[tuple[float, int, str]] = [(float(at), 0, f"b{i}") for i, at in enumerate(arrivals)]
    heapq.heapify(events)
    contention = Contention()
    full_rate = run.max_batch_size / cost.batch_s(run.max_batch_size, run.tokens)
    waits: list[float] = []
    flood_done = 0
    now, busy_until = 0.0, 0.0
    while len(waits) < run.trickle_jobs:
        if now >= busy_until:
            limit = batch_limit(contention, items_per_s=full_rate, slice_s=run.max_wait_ms / 1000,
                                now=now) if run.fair else None
            batch = batcher.take(now, limit=limit)
            if batch is not None:
                took = cost.batch_s(len(batch.items), run.tokens)
                if turns is not None and batch.tenant is not None:
                    turns.charge(batch.tenant, took)
                    contention.used(batch.tenant, took, now)
                for item in batch.items:
                    if item.tenant == "b":
                        waits.append(now - item.enqueued_at)
                    else:
                        flood_done += 1
                busy_until = now + took
                continue
        # The next instant anything can change: an arrival, the model freeing, a batch's window.
        deadline = batcher.next_deadline()
        now = min([at for at in (events[0][0] if events else None, busy_until if busy_until > now else None,
                                 deadline if deadline is not None and deadline > now else None) if at is not None])
        while events and events[0][0] <= now:
            at, _, name = heapq.heappop(events)
            batcher.add(Item(id=name, tenant="b", cost=run.tokens, enqueued_at=at))
            contention.saw("b", at)
        if run.flood and flood_done < run.flood_jobs:
            contention.saw("a", now)
    ms = np.array(waits) * 1000.0
    return FairnessResult(trickle_wait_p50_ms=float(np.percentile(ms, 50)),
                          trickle_wait_p99_ms=float(np.percentile(ms, 99)), flood_done=flood_done)
