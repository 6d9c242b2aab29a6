"""What a worker holds: the stream entries it has read and neither acknowledged nor released, kept
its own while it holds them, and how many it may hold.

Exactly once while workers live: an entry can wait in the prefetch, or on a model slower than
`claim_after_s`, for longer than XAUTOCLAIM's idle threshold, so the worker refreshes everything
it holds every third of that threshold (`StreamConsumer.refresh`); only a worker that stops
refreshing (dead, or stalled that long) has its entries taken over. It also holds no more than
it can start within half the threshold (`held_limit`), so waiting work stays where an idle
worker can read it.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter
from collections.abc import Callable

from sluice.errors import BrokerError
from sluice.vocabulary import Lane
from sluice.wire.connections import stop_if_cancelled
from sluice.wire.streams import StreamConsumer

log = logging.getLogger("workers.worker")

# Held entries are refreshed this many times per claim_after_s: two refreshes can fail (a Redis
# blip) before another worker could take them over.
REFRESHES_PER_CLAIM = 3


def held_limit(*, prefetch: int, max_batch_size: int, items_per_s: float, claim_after_s: float) -> int:
    """How many entries a worker may hold (read and not yet acknowledged).

    `prefetch` at most; once the service rate is measured, no more than the worker can start
    within half of `claim_after_s`, but never under two batches (one on the model, the next one
    formed), or the model would wait on Redis between batches.
    """
    if items_per_s <= 0:
        return prefetch
    return min(prefetch, max(2 * max_batch_size, math.floor(items_per_s * claim_after_s / 2)))


def releasable(room: int, reserve: int) -> int:
    """How many held jobs of a lane a worker with `room` places may release into its stream: the
    room less the `reserve` it keeps for jobs written to the stream directly, but never nothing
    while it has a place. A version whose batches hold one job has room for one bulk job, and
    keeping that place back for arrivals released none of its backlog, ever."""
    return room - reserve if room > reserve else min(room, 1)


class Holdings:
    def __init__(self, *, streams: StreamConsumer, name: str, claim_after_s: float) -> None:
        self.streams = streams
        self.name = name
        self.claim_after_s = claim_after_s
        self._lanes: dict[str, Lane] = {}  # entry id -> lane

    def __len__(self) -> int:
        return len(self._lanes)

    def __contains__(self, entry_id: object) -> bool:
        return entry_id in self._lanes

    def hold(self, entry_id: str, lane: Lane) -> None:
        self._lanes[entry_id] = lane

    def let_go(self, entry_id: str) -> None:
        """No longer held: acknowledged, released, or another worker's now."""
        self._lanes.pop(entry_id, None)

    def per_lane(self) -> Counter[Lane]:
        return Counter(self._lanes.values())

    async def keep(self, give_up: Callable[[set[str]], None]) -> None:
        """Refresh what is held, for ever; the entries found no longer this worker's (acknowledged
        meanwhile, or taken over while it stalled) go to `give_up`."""
        warned = False
        while True:
            await asyncio.sleep(self.claim_after_s / REFRESHES_PER_CLAIM)
            held: dict[Lane, list[str]] = {}
            for entry_id, lane in self._lanes.items():
                held.setdefault(lane, []).append(entry_id)
            try:
                lost = await self.streams.refresh(held)
                stop_if_cancelled()
            except BrokerError as exc:
                stop_if_cancelled(exc)
                if not warned:
                    log.warning("worker %s could not refresh the entries it holds: %s", self.name, exc)
                warned = True
                continue
            warned = False
            if lost:
                give_up(lost)
