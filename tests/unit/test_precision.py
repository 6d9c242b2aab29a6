"""The precision choice of MiniLM versions: what ``?quantize=`` resolves to, given int8's
measured speed-up and the margin, and the calibration that measures it (fake encoders and clocks)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from workers.models.precision import (
    AUTO,
    CALIBRATION_BATCHES,
    FP32,
    INT8,
    calibrate,
    choose,
    needs_calibration,
)


@pytest.mark.parametrize(
    "requested, eight_bit, speedup, margin, expected",
    [
        # auto: int8 only with 8-bit activations and a measured speed-up of at least the margin.
        (AUTO, True, 1.77, 1.15, INT8),
        (AUTO, True, 1.15, 1.15, INT8),
        (AUTO, True, 1.149, 1.15, FP32),
        (AUTO, True, 0.8, 1.15, FP32),
        (AUTO, True, 1.77, 2.0, FP32),
        (AUTO, True, 1.2, 1.0, INT8),
        (AUTO, True, None, 1.15, FP32),
        (AUTO, False, 3.0, 1.15, FP32),
        # Explicit requests are honoured whatever was measured.
        (INT8, True, 0.5, 1.15, INT8),
        (INT8, False, None, 1.15, INT8),
        (FP32, True, 3.0, 1.15, FP32),
        (None, True, 3.0, 1.15, FP32),
    ],
)
def test_choice_from_request_ratio_and_margin(
    requested: str | None, eight_bit: bool, speedup: float | None, margin: float, expected: str
) -> None:
    choice = choose(requested, eight_bit=eight_bit, speedup=speedup, min_speedup=margin)
    assert choice.precision == expected
    assert choice.requested == (requested or FP32)
    assert choice.speedup == speedup


def test_explicit_int8_below_the_margin_runs_and_is_flagged() -> None:
    slow = choose(INT8, eight_bit=True, speedup=0.9, min_speedup=1.15)
    assert (slow.precision, slow.below_margin) == (INT8, True)
    assert "0.90x" in slow.reason and "1.15x" in slow.reason
    assert not choose(INT8, eight_bit=True, speedup=1.5, min_speedup=1.15).below_margin
    assert not choose(INT8, eight_bit=True, speedup=None).below_margin
    # auto never flags: it simply does not run int8 there.
    assert not choose(AUTO, eight_bit=True, speedup=0.9).below_margin


def test_a_choice_refuses_unknown_requests_and_margins_under_one() -> None:
    with pytest.raises(ValueError):
        choose("int4", eight_bit=True, speedup=2.0)
    with pytest.raises(ValueError):
        choose(AUTO, eight_bit=True, speedup=2.0, min_speedup=0.9)


@pytest.mark.parametrize(
    "requested, eight_bit, expected",
    [
        (AUTO, True, True),
        (AUTO, False, False),
        (INT8, True, True),
        (INT8, False, True),
        (FP32, True, False),
        (FP32, False, False),
    ],
)
def test_only_auto_on_eight_bit_hosts_and_explicit_int8_are_measured(
    requested: str, eight_bit: bool, expected: bool
) -> None:
    assert needs_calibration(requested, eight_bit=eight_bit) is expected


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeEncoder:
    """Advances the clock by ``costs[n]`` per text during its n-th pass over the batches."""

    def __init__(self, name: str, costs: Sequence[float], clock: FakeClock, calls: list[str]) -> None:
        self.name, self.costs, self.clock, self.calls = name, costs, clock, calls
        self.passes = -1

    def encode(self, texts: Sequence[str]) -> object:
        if texts is CALIBRATION_BATCHES[0]:
            self.passes += 1
            self.calls.append(self.name)
        self.clock.now += len(texts) * self.costs[self.passes]
        return None


TEXTS = sum(len(batch) for batch in CALIBRATION_BATCHES)


def test_calibration_measures_rounds_after_an_unmeasured_pass_alternating_the_order() -> None:
    clock, calls = FakeClock(), []
    fp32 = FakeEncoder("fp32", [1.0] + [0.010] * 4, clock, calls)
    int8 = FakeEncoder("int8", [1.0] + [0.005] * 4, clock, calls)
    measured = calibrate(fp32, int8, rounds=4, cpu_clock=clock, wall_clock=clock)
    assert calls == ["fp32", "int8", "fp32", "int8", "int8", "fp32", "fp32", "int8", "int8", "fp32"]
    # The first, slow pass of each is left out of every figure.
    assert measured.speedups == pytest.approx((2.0,) * 4)
    assert measured.speedup == pytest.approx(2.0)
    assert measured.fp32_cpu_s == pytest.approx(4 * TEXTS * 0.010)
    assert measured.int8_cpu_s == pytest.approx(4 * TEXTS * 0.005)
    assert measured.wall_speedup == pytest.approx(2.0)


def test_one_disturbed_round_does_not_move_the_median() -> None:
    clock = FakeClock()
    fp32 = FakeEncoder("fp32", [0.010] * 6, clock, [])
    # int8's third measured pass runs ten times slower (a neighbour's burst).
    int8 = FakeEncoder("int8", [0.005, 0.005, 0.005, 0.050, 0.005, 0.005], clock, [])
    measured = calibrate(fp32, int8, rounds=5, cpu_clock=clock, wall_clock=clock)
    assert measured.speedups[2] == pytest.approx(0.2)
    assert measured.speedup == pytest.approx(2.0)


def test_a_clock_that_does_not_move_counts_as_equal_speed() -> None:
    clock = FakeClock()
    frozen = FakeClock()
    encoder = FakeEncoder("x", [0.01] * 4, clock, [])
    measured = calibrate(encoder, encoder, rounds=1, cpu_clock=frozen, wall_clock=frozen)
    assert (measured.speedup, measured.wall_speedup) == (1.0, 1.0)
    with pytest.raises(ValueError):
        calibrate(encoder, encoder, rounds=0, cpu_clock=clock, wall_clock=clock)
