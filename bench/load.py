"""Open-loop load generation: arrival timetables fixed in advance and a sender that keeps to them."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any


def poisson_timetable(rate_per_s: float, n: int, seed: int = 0) -> list[float]:
    """Offsets (s from start) of `n` Poisson arrivals at `rate_per_s`, fixed in advance."""
    rng = random.Random(seed)
    t = 0.0
    out = []
    for _ in range(n):
        t += rng.expovariate(rate_per_s)
        out.append(t)
    return out


def uniform_timetable(rate_per_s: float, n: int) -> list[float]:
    return [(i + 1) / rate_per_s for i in range(n)]


@dataclass(slots=True)
class Sent:
    index: int
    scheduled_at: float  # epoch seconds: when this request was due
    sent_at: float = math.nan  # epoch seconds: when the request actually left
    answered_at: float = math.nan  # epoch seconds: when the submit call returned
    result: Any = None
    error: str | None = None


async def open_loop(offsets: Sequence[float], send: Callable[[int], Awaitable[Any]]) -> list[Sent]:
    """Call `send(i)` at start + offsets[i], whether or not earlier calls have answered.

    The timetable is fixed before the run, so a slow system cannot slow the arrivals down
    (no coordinated omission): latency must be measured from `scheduled_at`, not `sent_at`.
    """
    loop = asyncio.get_running_loop()
    start_mono = loop.time() + 0.05
    start_epoch = time.time() + 0.05
    records = [Sent(index=i, scheduled_at=start_epoch + off) for i, off in enumerate(offsets)]

    async def one(record: Sent) -> None:
        record.sent_at = time.time()
        try:
            record.result = await send(record.index)
        except Exception as exc:  # recorded, the run goes on
            record.error = f"{type(exc).__name__}: {exc}"
        record.answered_at = time.time()

    tasks: list[asyncio.Task[None]] = []
    for record, off in zip(records, offsets, strict=True):
        delay = start_mono + off - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(record)))
    await asyncio.gather(*tasks)
    return records
