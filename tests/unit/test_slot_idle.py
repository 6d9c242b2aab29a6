"""A model slot's idle time is charged to the turn that ends it (workers/slots.py, sluice/cost.py)."""

from __future__ import annotations

from workers.slots import ExecutionSlots


async def test_each_turn_learns_how_long_its_slot_sat_idle_before_it() -> None:
    now = [100.0]
    slots = ExecutionSlots(slots=1, clock=lambda: now[0])
    now[0] = 103.0
    async with slots.turn(version=("m", "v1"), rank=(0, 0)) as first:
        assert first.idle_s == 3.0  # free since the slots were made
        now[0] = 105.0  # two seconds on the model: not idle
        first.used(2.0)
    now[0] = 105.5
    async with slots.turn(version=("m", "v2"), rank=(0, 0)) as second:
        assert second.idle_s == 0.5
    async with slots.turn(version=("m", "v1"), rank=(0, 0)) as third:
        assert third.idle_s == 0.0  # back to back
