"""Re-tuning on the served mix, in the simulator (scheduler/planning/retune.py)."""

from __future__ import annotations

import pytest

from scheduler.planning.capacity_sim import CostModel
from scheduler.planning.retune import Grid, Proposal, plan
from sluice.mix import Mix

# A padding handler on one CPU thread: a pass has a fixed cost, then every padded token costs.
COST = CostModel(fixed_s=0.008, per_item_s=0.0002, per_token_s=0.00003, cold_start_s=0.0)
GRID = Grid(batch_sizes=(2, 8, 32), waits_ms=(0.0, 20.0), fractions=(0.5, 0.8, 0.95), phase_s=5.0)
SHORT = Mix.of_costs([12] * 80 + [24] * 20)
LONG = Mix.of_costs([12] * 20 + [300] * 80)
BUDGET_MS = 150.0


def test_the_proposal_changes_when_the_mix_turns_long() -> None:
    """Tuned on short texts, then fed long ones: the same budget asks for another setting, and the
    setting tuned on short texts sustains less on the long texts than the new proposal."""
    on_short = plan(mix=SHORT, cost=COST, p99_budget_ms=BUDGET_MS, max_batch_size=8, max_wait_ms=0.0, now=1.0,
                    grid=GRID)
    assert on_short is not None
    on_long = plan(mix=LONG, cost=COST, p99_budget_ms=BUDGET_MS, max_batch_size=on_short.max_batch_size,
                   max_wait_ms=on_short.max_wait_ms, now=2.0, grid=GRID)
    assert on_long is not None
    assert (on_long.max_batch_size, on_long.max_wait_ms) != (on_short.max_batch_size, on_short.max_wait_ms)
    assert on_long.p99_ms <= BUDGET_MS and on_short.p99_ms <= BUDGET_MS
    # The old setting on the new mix is the comparison the gain reports.
    assert on_long.current_rps is not None and on_long.gain is not None and on_long.gain > 0
    assert on_long.on == {"mix": LONG.to_mapping(), "samples": 100}
    assert on_long.planned_at == 2.0


def test_the_same_inputs_give_the_same_proposal() -> None:
    first = plan(mix=LONG, cost=COST, p99_budget_ms=BUDGET_MS, max_batch_size=32, max_wait_ms=20.0, now=0.0,
                 grid=GRID)
    again = plan(mix=LONG, cost=COST, p99_budget_ms=BUDGET_MS, max_batch_size=32, max_wait_ms=20.0, now=0.0,
                 grid=GRID)
    assert first == again


def test_a_budget_no_setting_meets_proposes_nothing() -> None:
    assert plan(mix=LONG, cost=COST, p99_budget_ms=1.0, max_batch_size=8, max_wait_ms=0.0, now=0.0,
                grid=GRID) is None
    with pytest.raises(ValueError, match="budget"):
        plan(mix=LONG, cost=COST, p99_budget_ms=0.0, max_batch_size=8, max_wait_ms=0.0, now=0.0, grid=GRID)


def _proposal(current_rps: float | None) -> Proposal:
    return Proposal(max_batch_size=8, max_wait_ms=5.0, throughput_rps=110.0, p99_ms=90.0, p99_budget_ms=100.0,
                    current_rps=current_rps, planned_at=0.0)


def test_a_proposal_is_worth_applying_past_the_threshold_or_where_the_current_setting_fails() -> None:
    assert _proposal(100.0).gain == pytest.approx(0.1)
    assert _proposal(100.0).worth_applying(max_batch_size=32, max_wait_ms=5.0, min_gain=0.05)
    assert not _proposal(100.0).worth_applying(max_batch_size=32, max_wait_ms=5.0, min_gain=0.2)
    assert _proposal(None).worth_applying(max_batch_size=32, max_wait_ms=5.0, min_gain=0.2)
    # The setting it already has is never applied again.
    assert not _proposal(None).worth_applying(max_batch_size=8, max_wait_ms=5.0, min_gain=0.0)
