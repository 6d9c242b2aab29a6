"""Where a queued job stands: how many jobs are ahead of it in its version's lane, and when it may
start. Pure: the numbers come from the queue script's job numbers (`sluice.wire.keys.queue_added`,
`queue_read`), the lane's held queues (`sluice.wire.keys.held_index`) and the version's measured
service rate, so the simulator can use it unchanged.

Both figures are estimates, and the API documents them so: a job ahead that is cancelled or
expires before a worker reads it still counts until the reading passes it, and the start is the
jobs in front over the rate the live workers measure. The position counts the jobs no worker has
read; the start counts also those the workers have read and not finished (`also_ahead`), which
under a backlog are a prefetch of a few batches per worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Standing:
    queue_position: int  # jobs ahead of it in its version and lane; 0: the next one read
    estimated_start_s: float | None  # None while no live worker has measured its rate


def standing(*, seq: int, read: int, also_ahead: int = 0, service_rate: float) -> Standing | None:
    """A job numbered `seq` in a lane whose workers have read up to number `read`. `also_ahead`:
    the jobs in front of it that its position leaves out, those the workers have read and not
    finished and, for a bulk job, the online lane's. Starting takes the jobs in front, and the job
    itself, at `service_rate` jobs a second.
    None for a queued job whose number was read already: one its retry policy queued again under
    its first number, whose place the numbers no longer tell."""
    if seq <= read:
        return None
    position = seq - read - 1
    if service_rate <= 0:
        return Standing(position, None)
    return Standing(position, round((position + max(0, also_ahead) + 1) / service_rate, 3))


def held_standing(*, unread: int, index: int, priority: int, tenant: str, share: float,
                  held: Mapping[tuple[int, str], int], also_ahead: int = 0,
                  service_rate: float) -> Standing:
    """A job held in its tenant's queue of its priority (queue.lua), `index` jobs behind that
    queue's first, in a lane whose stream has `unread` entries no worker has read. In front of it:
    those entries, every job held at a more urgent priority, and of the other tenants at its own
    priority as many as fair turns (sluice/fair_share.py) release before it, taking their shares
    as 1. Ageing and jobs still to come are not foreseen."""
    fair = 0.0
    for (other_priority, other), count in held.items():
        if other_priority < priority:
            fair += count
        elif other_priority == priority and other != tenant:
            fair += min(count, (index + 1) / share)
    position = unread + index + int(fair)
    if service_rate <= 0:
        return Standing(position, None)
    return Standing(position, round((position + max(0, also_ahead) + 1) / service_rate, 3))
