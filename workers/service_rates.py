"""A worker's measured speed, which its heartbeat carries: how fast it serves, and how fast a
backlog drains on it.

Two rates over the last passes, each answering a different question (docs/ARCHITECTURE.md, "Where
a queued job stands"):
- the service rate, items per model-second of every stored pass: capacity while busy, not
  wall-clock throughput, since an idle worker must not look slow or a burst after a quiet spell
  would be shed; the prefetch limit and the tenants' turns use it too;
- the backlog rate, items per wall-clock second of the passes run while more work waited behind
  them: what a queued job's estimated start divides by. After light traffic the recent passes hold
  one job each while a backlog runs in full ones, and between a backlog's passes the claim, the
  other versions' turns on the process's model and the event loop's reads and stores take time
  that model seconds leave out.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

# Passes per window: long enough to smooth one slow pass, short enough to follow a new mix.
WINDOW_PASSES = 64


def _items_per_s(window: Iterable[tuple[int, float]]) -> float:
    """Items over the seconds of a window of passes; 0 for none."""
    passes = list(window)
    seconds = sum(spent for _, spent in passes)
    return sum(items for items, _ in passes) / seconds if seconds > 0 else 0.0


class ServiceRates:
    def __init__(self, *, window: int = WINDOW_PASSES) -> None:
        self._stored: deque[tuple[int, float]] = deque(maxlen=window)  # (items, model seconds)
        self._backlog: deque[tuple[int, float]] = deque(maxlen=window)  # (items, wall seconds)

    def stored(self, items: int, model_s: float) -> None:
        """A pass whose outcomes were stored, and the model seconds it took."""
        self._stored.append((items, model_s))

    def drained(self, items: int, wall_s: float) -> None:
        """A pass run while more work waited, and the wall time of the runner's turn that ran it."""
        self._backlog.append((items, wall_s))

    def items_per_s(self) -> float:
        """Items per model-second of the stored passes; 0 before the first."""
        return _items_per_s(self._stored)

    def backlog_items_per_s(self) -> float:
        """Items per wall-clock second of the passes run with work waiting; 0 before the first."""
        return _items_per_s(self._backlog)
