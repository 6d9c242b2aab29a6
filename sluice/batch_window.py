"""How long a batch waits for more jobs: up to `max_wait_ms`, and only while another is expected.

A fixed window costs every job up to `max_wait_ms` of queueing and buys a bigger batch only when
jobs arrive faster than one a window. At a trickle nothing joins and the whole window is lost; at
a flood the batch fills by size first. So the window a batch actually waits is

    max(0, max_wait - mean gap between the lane's recent arrivals)

that is, a batch closes once the next job would be expected after its deadline. Slow arrivals (a
gap at or above `max_wait_ms`) run at once; fast ones wait almost the whole `max_wait_ms`, which
stays the bound no job waits past (docs/ARCHITECTURE.md, "The micro-batcher's window").

The gap is measured on the jobs' own enqueue times, over the last `keep` arrivals of one lane
within `horizon_s` of the newest: a burst shows its rate from its second job, and a job after a
quiet spell, alone within the horizon, has no gap at all (it runs at once). Only the arrivals
move it, never the clock, so a deadline stays put between two of them and a caller sleeping until
it wakes on the exact float it was given.
"""

from __future__ import annotations

import math
from collections import deque

__all__ = ["ArrivalGaps", "waited_window_s"]


class ArrivalGaps:
    """The mean gap between one lane's recent arrivals, from their enqueue times."""

    __slots__ = ("_horizon_s", "_times")

    def __init__(self, *, keep: int = 16, horizon_s: float = 1.0) -> None:
        if keep < 2:
            raise ValueError(f"keep must be >= 2, got {keep}")
        if not horizon_s > 0:
            raise ValueError(f"horizon_s must be > 0, got {horizon_s}")
        self._times: deque[float] = deque(maxlen=keep)
        self._horizon_s = horizon_s

    def add(self, enqueued_at: float) -> None:
        self._times.append(enqueued_at)

    def mean_gap_s(self) -> float:
        """The mean gap over the kept arrivals within the horizon of the newest; inf with fewer
        than two of them. Enqueue times may come out of order (a reclaimed job, a backlog read
        late): the span is taken over their range, not their order."""
        if len(self._times) < 2:
            return math.inf
        newest = max(self._times)
        recent = [t for t in self._times if t >= newest - self._horizon_s]
        if len(recent) < 2:
            return math.inf
        return (newest - min(recent)) / (len(recent) - 1)


def waited_window_s(max_wait_s: float, mean_gap_s: float) -> float:
    """How long a batch of a lane with this arrival gap waits for more: in [0, max_wait_s]."""
    return min(max_wait_s, max(0.0, max_wait_s - mean_gap_s))
