"""One warm worker replica in simulated time, batching as `workers.worker.Worker` does.

The frontier sweep's simulator (scheduler/planning/frontier.py). Jobs arrive on a trace and wait in the
stream; the replica reads them into the real `sluice.batcher.MicroBatcher` while it holds fewer
than its prefetch (`prefetch_batches` x `max_batch_size`, held = read and not yet finished), takes
the most urgent batch whenever the model is free, and runs it at `CostModel`'s cost (fixed + per
job + per padded token). A handler that plans its own forward passes (MiniLM) gets one length
bucket and its batch split by `passes`, the pass holding the oldest job first, each pass finishing
its own jobs, and the other passes run before any new batch: as the worker runs them.

Not `scheduler.planning.capacity_sim`: that one is a pool under an autoscaler with its own batcher settings
(length buckets and top-up always on, nothing held back); this one is a single replica with
exactly the worker's batcher settings (top-up off, buckets only where the handler pads).
Redis round trips and the time to store results are not modelled.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from scheduler.planning.capacity_sim import CostModel
from sluice.batcher import DEFAULT_BUCKET_BOUNDS, Batch, Item, MicroBatcher

# The model token counts of a formed batch's jobs -> its forward passes, as positions in that list
# (a MiniLM encoder's `passes`).
PassPlan = Callable[[Sequence[int]], list[list[int]]]


@dataclass(frozen=True, slots=True)
class SimJob:
    at: float  # arrival, seconds
    cost: int  # the batcher's cost hint (the API's token estimate)
    tokens: int  # what the model pads to: its own token count


@dataclass(slots=True)
class SimOutcome:
    finished: list[float]  # per job, in trace order (nan: never ran)
    batch_sizes: list[int] = field(default_factory=list)  # per forward pass


def run_replica(jobs: Sequence[SimJob], *, max_batch_size: int, max_wait_ms: float, cost: CostModel,
                passes: PassPlan | None = None, prefetch_batches: int = 4, adaptive_wait: bool = False) -> SimOutcome:
    """Every job of `jobs` (sorted by arrival) through one replica; when each finished.

    `passes` None: the handler pads a batch to its longest job, so jobs are grouped by length
    first (the default buckets) and a batch is one pass.
    """
    batcher: MicroBatcher[int] = MicroBatcher(
        max_batch_size=max_batch_size, max_wait_ms=max_wait_ms, isolate_tenants=False, top_up=False,
        bucket_bounds=DEFAULT_BUCKET_BOUNDS if passes is None else (), adaptive_wait=adaptive_wait)
    limit = prefetch_batches * max_batch_size
    outcome = SimOutcome(finished=[math.nan] * len(jobs))
    stream: deque[int] = deque()
    waiting: deque[list[int]] = deque()  # the remaining passes of the last batch
    running: list[int] = []
    busy_until = math.inf
    held = 0
    arrived = 0
    now = 0.0
    while True:
        while arrived < len(jobs) and jobs[arrived].at <= now:
            stream.append(arrived)
            arrived += 1
        if running and busy_until <= now:
            for index in running:
                outcome.finished[index] = busy_until
            held -= len(running)
            running, busy_until = [], math.inf
        while stream and held < limit:
            index = stream.popleft()
            job = jobs[index]
            batcher.add(Item(id=str(index), tenant="t", cost=job.cost, enqueued_at=job.at, payload=index))
            held += 1
        if not running:
            running = waiting.popleft() if waiting else _start(batcher.take(now), jobs, passes, waiting)
            if running:
                outcome.batch_sizes.append(len(running))
                busy_until = now + cost.batch_s(len(running), max(jobs[i].tokens for i in running))
        deadline = batcher.next_deadline() if not running else None
        upcoming = min(jobs[arrived].at if arrived < len(jobs) else math.inf, busy_until,
                       deadline if deadline is not None else math.inf)
        if upcoming == math.inf:
            return outcome
        now = max(now, upcoming)


def _start(batch: Batch[int] | None, jobs: Sequence[SimJob], passes: PassPlan | None,
           waiting: deque[list[int]]) -> list[int]:
    """The first pass of a batch just taken (the others queue in `waiting`); [] for no batch."""
    if batch is None:
        return []
    indices = [item.payload for item in batch.items]
    if passes is None or len(indices) == 1:
        return indices
    plan = passes([jobs[i].tokens for i in indices])
    # Job indices follow arrival order, so a pass's smallest index is its oldest job.
    parts = sorted(([indices[p] for p in sorted(part)] for part in plan if part), key=min)
    waiting.extend(parts[1:])
    return parts[0]
