"""The reconnect backoff: doubling from its base to its cap, reset by a success, jittered within its
band from the random source it is given."""

from __future__ import annotations

import random

import pytest

from sluice.backoff import Backoff


def test_without_jitter_it_doubles_from_the_base_to_the_cap() -> None:
    backoff = Backoff(base_s=0.1, cap_s=5.0)
    delays = [backoff.failed() for _ in range(9)]
    expected, delay = [], 0.1
    for _ in range(9):
        expected.append(delay)
        delay = min(delay * 2, 5.0)
    assert delays == expected
    assert delays[-1] == 5.0 and backoff.failures == 9


def test_a_success_starts_again_from_the_base() -> None:
    backoff = Backoff(base_s=0.05, cap_s=5.0)
    assert backoff.failures == 0
    backoff.failed()
    backoff.failed()
    backoff.succeeded()
    assert backoff.failures == 0
    assert backoff.failed() == 0.05
    assert backoff.failures == 1


def test_jitter_draws_each_delay_between_its_floor_and_all_of_it() -> None:
    backoff = Backoff(base_s=0.05, cap_s=5.0, jitter=0.5, rng=random.Random(11))
    steps = [min(0.05 * 2**n, 5.0) for n in range(12)]
    for step in steps:
        assert step * 0.5 <= backoff.failed() <= step
    # At the cap, many draws spread over the band rather than repeating one value.
    capped = [backoff.failed() for _ in range(200)]
    assert all(2.5 <= delay <= 5.0 for delay in capped)
    assert max(capped) - min(capped) > 1.0


def test_the_same_seed_gives_the_same_delays() -> None:
    def delays(seed: int) -> list[float]:
        backoff = Backoff(base_s=0.1, cap_s=5.0, jitter=0.5, rng=random.Random(seed))
        return [backoff.failed() for _ in range(10)]

    assert delays(3) == delays(3)
    assert delays(3) != delays(4)


@pytest.mark.parametrize("jitter", [-0.1, 1.5])
def test_a_jitter_outside_zero_to_one_is_refused(jitter: float) -> None:
    with pytest.raises(ValueError, match="jitter"):
        Backoff(base_s=0.1, cap_s=5.0, jitter=jitter)
