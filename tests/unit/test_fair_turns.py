"""Whose batch runs next in a shared process (sluice/fair_turns.py), in simulated time, and the
asyncio slots over it (workers/slots.py)."""

from __future__ import annotations

import asyncio
from collections import deque

import pytest

from sluice.fair_turns import FairTurns
from workers.slots import ExecutionSlots

ONLINE, BULK = (0, 0), (0, 1)


def simulate(*, flood_rank: tuple[int, int], batch_s: float, trickle_every_s: float, max_wait_s: float,
             until_s: float) -> list[float]:
    """One slot; version A always has a batch ready, version B's single jobs close at max_wait.
    Answers B's waits from ready to start."""
    turns = FairTurns(slots=1)
    now, waits = 0.0, []
    ready_b: deque[float] = deque()
    next_b = trickle_every_s
    tickets = iter(range(10**9))
    running: tuple[int, str, float] | None = None
    turns.request(next(tickets), version="A", rank=flood_rank, now=now)
    asked_b: dict[int, float] = {}
    while now < until_s:
        if running is None:
            for ticket in turns.grant(now):
                if ticket in asked_b:
                    waits.append(now - asked_b.pop(ticket))
                    running = (ticket, "B", now + batch_s / 4)
                else:
                    running = (ticket, "A", now + batch_s)
        assert running is not None
        ticket, version, ends = running
        # Advance to the next event: the batch's end or B's next batch closing.
        closes = next_b + max_wait_s
        if closes < ends:
            now = closes
            next_b += trickle_every_s
            ready_b.append(now)
            new = next(tickets)
            asked_b[new] = now
            turns.request(new, version="B", rank=ONLINE, now=now)
            continue
        now = ends
        turns.release(ticket, model_s=ends - (ends - (batch_s if version == "A" else batch_s / 4)), now=now)
        running = None
        if version == "A":
            turns.request(next(tickets), version="A", rank=flood_rank, now=now)
    return waits


@pytest.mark.parametrize("flood_rank", [ONLINE, BULK], ids=["same-rank flood", "bulk flood"])
def test_a_flood_never_holds_a_trickle_back_by_more_than_one_batch(flood_rank: tuple[int, int]) -> None:
    waits = simulate(flood_rank=flood_rank, batch_s=0.2, trickle_every_s=0.3, max_wait_s=0.01, until_s=120)
    assert len(waits) > 100 and max(waits) <= 0.2 + 1e-9


def test_online_before_bulk_and_latency_before_batch() -> None:
    turns = FairTurns(slots=1)
    turns.request("bulk", version="a", rank=(0, 1), now=0)
    turns.request("batch-tier", version="b", rank=(1, 0), now=0)
    turns.request("online", version="c", rank=(0, 0), now=0)
    order = []
    for _ in range(3):
        [ticket] = turns.grant(0)
        order.append(ticket)
        turns.release(ticket, model_s=0.1, now=0)
    assert order == ["online", "bulk", "batch-tier"]


def test_same_rank_versions_alternate_and_idle_time_earns_no_credit() -> None:
    turns = FairTurns(slots=1)
    for i in range(10):  # a runs alone for 1 s of model time
        turns.request(f"a{i}", version="a", rank=ONLINE, now=i)
        [ticket] = turns.grant(i)
        turns.release(ticket, model_s=0.1, now=i)
    turns.request("a-next", version="a", rank=ONLINE, now=10)
    turns.request("b0", version="b", rank=ONLINE, now=10)  # back from idle: starts at a's virtual time
    order = []
    for i in range(4):
        [ticket] = turns.grant(10)
        order.append(ticket)
        turns.release(ticket, model_s=0.1, now=10)
        turns.request(f"{ticket[0]}-{i}", version=ticket[0], rank=ONLINE, now=10)
    assert [t[0] for t in order] in (["a", "b", "a", "b"], ["b", "a", "b", "a"]), order


def test_two_slots_and_a_cancelled_ask_frees_its_place() -> None:
    turns = FairTurns(slots=2)
    for name in ("x", "y", "z"):
        turns.request(name, version=name, rank=ONLINE, now=0)
    assert turns.grant(0) == ["x", "y"]
    turns.cancel("x")
    assert turns.grant(0) == ["z"]


async def test_the_slots_serialise_runs_and_a_cancelled_waiter_leaks_nothing() -> None:
    slots = ExecutionSlots(slots=1)
    inside = 0
    most = 0

    async def run(version: str) -> None:
        nonlocal inside, most
        async with slots.turn(version=version, rank=ONLINE) as turn:
            inside += 1
            most = max(most, inside)
            await asyncio.sleep(0.01)
            turn.used(0.01)
            inside -= 1

    waiter = asyncio.create_task(run("gone"))
    await asyncio.gather(*(run(v) for v in "abcabc"), asyncio.sleep(0))
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    await asyncio.wait_for(run("after"), timeout=1)
    assert most == 1 and slots.turns.waiting() == 0
