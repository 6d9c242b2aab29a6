"""The served mix's buckets and its drift (sluice/mix.py)."""

from __future__ import annotations

import pytest

from sluice.mix import BUCKET_LABELS, COST_BOUNDS, Mix, bucket_of, bucket_range, drift


def test_a_cost_counts_in_the_first_bucket_whose_bound_holds_it() -> None:
    assert [bucket_of(c) for c in (0, 1, 2, 3, 4, 5, 4096, 4097, 10**6)] == [0, 0, 1, 2, 2, 3, 12, 13, 13]
    assert len(BUCKET_LABELS) == len(COST_BOUNDS) + 1


def test_the_buckets_ranges_cover_every_cost_once() -> None:
    covered = [cost for index in range(len(COST_BOUNDS)) for cost in range(bucket_range(index)[0],
                                                                           bucket_range(index)[1] + 1)]
    assert covered == list(range(1, COST_BOUNDS[-1] + 1))
    assert all(bucket_of(cost) == index for index in range(len(BUCKET_LABELS)) for cost in bucket_range(index))


def test_a_mix_goes_through_its_mapping_unchanged() -> None:
    mix = Mix.of_costs([3, 3, 17, 300, 9000])
    assert mix.to_mapping() == {"4": 2, "32": 1, "512": 1, "inf": 1}
    assert Mix.from_mapping(mix.to_mapping()) == mix
    with pytest.raises(ValueError, match="unknown"):
        Mix.from_mapping({"5": 1})


def test_drift_is_the_total_variation_distance_of_the_shares() -> None:
    short = Mix.of_costs([10] * 80 + [20] * 20)
    assert drift(short, short) == 0
    # The same shares at ten times the traffic is no drift.
    assert drift(Mix.of_costs([10] * 800 + [20] * 200), short) == pytest.approx(0)
    assert drift(Mix.of_costs([300] * 5), short) == pytest.approx(1)
    # 80/20 against 20/80 over the same two buckets: half of |0.6| + |0.6|.
    assert drift(Mix.of_costs([10] * 20 + [20] * 80), short) == pytest.approx(0.6)
    assert drift(Mix(), short) is None


def test_a_sample_keeps_the_mix_s_shares_and_is_the_same_for_a_seed() -> None:
    mix = Mix.of_costs([10] * 75 + [300] * 25)
    costs = mix.sample(4000, seed=3)
    assert costs == mix.sample(4000, seed=3)
    distance = drift(Mix.of_costs(costs), mix)
    assert distance is not None and distance < 0.03
    assert all(9 <= c <= 16 or 257 <= c <= 512 for c in costs)
