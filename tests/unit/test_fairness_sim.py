"""The fairness simulator (scheduler/planning/fairness_sim.py) runs the worker's own batcher and
turns: with the rule, a trickle beside a 20,000-job flood waits about as it does alone; without
it, behind the whole flood."""

from __future__ import annotations

from scheduler.planning.capacity_sim import CostModel
from scheduler.planning.fairness_sim import FairnessRun, simulate_fairness

# Per-item cost dominating, as a CPU forward pass.
CPU_LIKE = CostModel(fixed_s=0.002, per_item_s=0.003, per_token_s=0.00005)


def test_the_rule_keeps_a_trickles_wait_near_its_wait_alone() -> None:
    # The trickle's first jobs wait for the flood's whole batch under way when they arrive (no
    # tenant contended before them): 1,500 jobs keep those few out of the 99th percentile.
    alone = simulate_fairness(FairnessRun(flood=False, trickle_jobs=1500), cost=CPU_LIKE)
    fair = simulate_fairness(FairnessRun(trickle_jobs=1500), cost=CPU_LIKE)
    unfair = simulate_fairness(FairnessRun(fair=False, trickle_jobs=600), cost=CPU_LIKE)
    assert fair.trickle_wait_p50_ms <= alone.trickle_wait_p50_ms, (alone, fair)
    assert fair.trickle_wait_p99_ms <= 1.5 * alone.trickle_wait_p99_ms, (alone, fair)
    assert fair.flood_done > 0  # the flood shares the worker, it is not stopped
    assert unfair.trickle_wait_p99_ms > 100 * fair.trickle_wait_p99_ms, (fair, unfair)
