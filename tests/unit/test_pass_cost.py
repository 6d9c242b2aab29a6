"""The pass planner's cost model fitted from timed passes: a fixed cost in tokens' worth."""

from __future__ import annotations

from workers.models.minilm import plan_passes
from workers.models.pass_cost import MAX_OVERHEAD_TOKENS, MIN_OVERHEAD_TOKENS, fit_overhead_tokens


def _timings(fixed_s: float, per_token_s: float, noise: float = 0.0) -> dict[tuple[int, int], list[float]]:
    shapes = ((1, 16), (16, 16), (1, 64), (4, 64))
    return {(n, w): [fixed_s + per_token_s * n * w + noise * k for k in (-1, 0, 0, 1, 5)] for n, w in shapes}


def test_the_fit_answers_the_fixed_cost_over_the_cost_of_a_token() -> None:
    # bf16 on AMX, as measured: 4.5 ms a pass, 50 us a token: 90 tokens' worth.
    assert fit_overhead_tokens(_timings(0.0045, 0.00005)) == 90
    # fp32 on the same host: 6.5 ms and 160 us.
    assert fit_overhead_tokens(_timings(0.0065, 0.00016)) == 41


def test_one_slow_outlier_per_shape_does_not_move_the_fit() -> None:
    assert fit_overhead_tokens(_timings(0.0045, 0.00005, noise=0.0001)) == 90


def test_timings_that_say_nothing_leave_the_planner_as_it_was() -> None:
    assert fit_overhead_tokens({}) is None
    assert fit_overhead_tokens({(1, 16): [0.01, 0.01], (16, 1): [0.02]}) is None  # one size of pass
    assert fit_overhead_tokens({(1, 16): [0.02], (16, 16): [0.01]}) is None  # bigger passes faster


def test_the_fit_stays_within_its_bounds() -> None:
    assert fit_overhead_tokens(_timings(-0.001, 0.00005)) == MIN_OVERHEAD_TOKENS
    assert fit_overhead_tokens(_timings(10.0, 0.00001)) == MAX_OVERHEAD_TOKENS


def test_a_dearer_pass_makes_the_planner_join_texts_it_split_before() -> None:
    # Six short texts and two long ones: at fp32's figure the short ones go apart from the long.
    lengths = [18, 20, 22, 19, 21, 23, 60, 64]
    assert len(plan_passes(lengths, max_batch_tokens=2048, overhead_tokens=24)) == 2
    assert len(plan_passes(lengths, max_batch_tokens=2048, overhead_tokens=400)) == 1
