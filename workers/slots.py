"""A worker process's execution slots, shared by the Workers of every version it serves.

`sluice.fair_turns.FairTurns` decides whose batch runs next; this wraps it for one asyncio loop:
a Worker with a batch ready enters `turn(...)`, waits there until granted, runs the batch on the
model, on a model thread of the slots' own (`run`), and says how long it took. A waiter cancelled
(a Worker stopping) gives its place or its slot back, so no slot leaks. A turn learns how long its
slot had sat with no batch before it: the pass that ends an idle spell is charged with it
(sluice/cost.py).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from itertools import count
from typing import Any, TypeVar

from sluice.fair_turns import FairTurns, Rank

TIER_RANK = {"latency": 0, "batch": 1}

Result = TypeVar("Result")


class Turn:
    def __init__(self) -> None:
        self.model_s = 0.0
        # How long the slot this turn took had sat with no batch: the turn is charged with it.
        self.idle_s = 0.0

    def used(self, model_s: float) -> None:
        self.model_s = model_s


class ExecutionSlots:
    def __init__(self, *, slots: int = 1, clock: Callable[[], float] = time.monotonic) -> None:
        self.turns = FairTurns(slots=slots)
        self.clock = clock
        self._granted: dict[Hashable, asyncio.Future[None]] = {}
        self._tickets = count()
        # When each free slot last went free (a stack: the turn granted next takes the latest).
        self._free_since = [clock()] * slots
        # The passes run on threads of their own, one a slot, rather than on asyncio's default pool
        # (six threads on 2 cores): PyTorch keeps some CPU kernels per thread and per pass shape
        # (the bf16 attention's), so passes spread over six threads built each shape's kernels up
        # to six times (docs/ARCHITECTURE.md, "Packed worker processes").
        self._model_threads = ThreadPoolExecutor(max_workers=slots, thread_name_prefix="sluice-model")

    async def run(self, call: Callable[..., Result], *args: Any) -> Result:
        """`call(*args)` on a model thread; the caller holds a turn."""
        return await asyncio.get_running_loop().run_in_executor(self._model_threads, functools.partial(call, *args))

    @asynccontextmanager
    async def turn(self, *, version: Hashable, rank: Rank) -> AsyncIterator[Turn]:
        ticket = next(self._tickets)
        granted = asyncio.get_running_loop().create_future()
        self._granted[ticket] = granted
        self.turns.request(ticket, version=version, rank=rank, now=self.clock())
        self._dispatch()
        turn = Turn()
        took = False
        try:
            await granted
            if self._free_since:
                turn.idle_s = max(0.0, self.clock() - self._free_since.pop())
                took = True
            yield turn
        finally:
            self._granted.pop(ticket, None)
            if took:
                self._free_since.append(self.clock())
            if granted.done() and not granted.cancelled():
                self.turns.release(ticket, model_s=turn.model_s, now=self.clock())
            else:
                self.turns.cancel(ticket)
            self._dispatch()

    def _dispatch(self) -> None:
        while tickets := self.turns.grant(self.clock()):
            left = False
            for ticket in tickets:
                future = self._granted.get(ticket)
                if future is not None and not future.done():
                    future.set_result(None)
                else:  # its waiter left between asking and the grant: the slot goes to the next
                    self.turns.cancel(ticket)
                    left = True
            if not left:
                return


def rank(tier: str, lane_priority: int) -> Rank:
    return TIER_RANK.get(tier, 0), lane_priority
