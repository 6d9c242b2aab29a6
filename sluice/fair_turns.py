"""Whose batch takes the model next, in a process serving several versions: pure, clock passed in.

Each version's Worker forms its own batches; a batch ready to run asks for a turn, and `grant`
answers which asks may start now, one per free slot:

* lowest rank first: the rank is (tier, lane), latency before batch, online before bulk;
* within a rank, the version that has used the least *virtual* model time (start-time fair
  queueing): a version's virtual time grows by the model seconds its batches take, and a version
  that becomes active again starts at the smallest virtual time among the active ones, so time
  spent idle earns no credit to spend later in a burst;
* ties to the version served least recently, then by the order of asking: a version back from
  idle starts level with the busiest one, and must not lose the tie to it.

The guarantee: a version with a ready batch waits for the batches already running (one per
slot) and for the versions behind it in virtual time, never for a flood. A flooding version
accumulates virtual time with every batch, so the moment another version of its rank asks, that
version is the one with the least; it runs as soon as a slot frees, after at most one of the
flood's batches per slot (docs/ARCHITECTURE.md, "Execution turns in a shared process").
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from itertools import count

Rank = tuple[int, int]  # (tier: 0 latency, 1 batch; lane: 0 online, 1 bulk)


@dataclass(slots=True)
class _Ask:
    version: Hashable
    rank: Rank
    order: int
    asked_at: float


class FairTurns:
    def __init__(self, *, slots: int = 1) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots = slots
        self._asks: dict[Hashable, _Ask] = {}  # ticket -> its ask, not granted yet
        self._running: dict[Hashable, Hashable] = {}  # ticket -> version
        self._virtual: dict[Hashable, float] = {}  # version -> model seconds used, shifted on return
        self._served: dict[Hashable, int] = {}  # version -> when it last got a turn (a sequence number)
        self._order = count()

    def request(self, ticket: Hashable, *, version: Hashable, rank: Rank, now: float) -> None:
        if not self._active(version):
            # Back from idle: no credit for the time away (rule 2 of the docstring).
            floor = min((self._virtual[v] for v in self._active_versions()), default=None)
            if floor is not None:
                self._virtual[version] = max(self._virtual.get(version, 0.0), floor)
        self._virtual.setdefault(version, 0.0)
        self._asks[ticket] = _Ask(version=version, rank=rank, order=next(self._order), asked_at=now)

    def grant(self, now: float) -> list[Hashable]:
        """The tickets that may start now, best first; each holds a slot until released."""
        granted = []
        while len(self._running) < self.slots and self._asks:
            ticket = min(self._asks, key=lambda t: (self._asks[t].rank, self._virtual[self._asks[t].version],
                                                    self._served.get(self._asks[t].version, -1), self._asks[t].order))
            ask = self._asks.pop(ticket)
            self._served[ask.version] = next(self._order)
            self._running[ticket] = ask.version
            granted.append(ticket)
        return granted

    def release(self, ticket: Hashable, *, model_s: float, now: float) -> None:
        version = self._running.pop(ticket, None)
        if version is not None:
            self._virtual[version] = self._virtual.get(version, 0.0) + max(0.0, model_s)

    def cancel(self, ticket: Hashable) -> None:
        """An ask withdrawn before or after its grant (a cancelled waiter): its slot is free again."""
        self._asks.pop(ticket, None)
        self._running.pop(ticket, None)

    def waiting(self) -> int:
        return len(self._asks)

    def _active(self, version: Hashable) -> bool:
        return version in self._running.values() or any(a.version == version for a in self._asks.values())

    def _active_versions(self) -> set[Hashable]:
        return {*self._running.values(), *(a.version for a in self._asks.values())}
