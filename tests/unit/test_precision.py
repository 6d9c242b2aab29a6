"""The precision rule: which candidates a host offers, what ``auto`` and an explicit request resolve
to given the measured speed-ups and quality, and the calibration that measures them (fake runs and
clocks; the real models are in tests/unit/test_precision_models.py)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from workers.models.precision import (
    AUTO,
    BF16,
    CALIBRATION_BATCHES,
    FP16,
    FP32,
    INT8,
    HostPrecisions,
    PrecisionPolicy,
    Quality,
    QualityBound,
    calibrate,
    candidates,
    choose,
)

AMX = HostPrecisions(device="cpu", bf16=True, int8=True)
OLD_CPU = HostPrecisions(device="cpu", bf16=False, int8=False)
VNNI_ONLY = HostPrecisions(device="cpu", bf16=False, int8=True)
GPU = HostPrecisions(device="cuda", bf16=True, int8=False)
OLD_GPU = HostPrecisions(device="cuda", bf16=False, int8=False)
POLICY = PrecisionPolicy(min_speedup=1.15, rounds=3)
CLOSE = Quality(worst_cosine=0.9999)
FAR = Quality(worst_cosine=0.998)


@pytest.mark.parametrize(
    "requested, host, expected",
    [
        (AUTO, AMX, (FP32, BF16, INT8)),
        (AUTO, VNNI_ONLY, (FP32, INT8)),
        (AUTO, OLD_CPU, (FP32,)),
        (AUTO, GPU, (FP32, BF16, FP16)),
        (AUTO, OLD_GPU, (FP32, FP16)),
        # Explicit requests are built beside fp32, to be measured; fp32 alone is nothing to measure.
        (INT8, OLD_CPU, (FP32, INT8)),
        (BF16, OLD_CPU, (FP32, BF16)),
        (FP16, GPU, (FP32, FP16)),
        (FP32, AMX, (FP32,)),
        # No option: fp32 on the CPU, bf16 on a GPU, as before the option existed.
        (None, AMX, (FP32,)),
        (None, GPU, (FP32, BF16)),
    ],
)
def test_the_candidates_follow_the_host(requested: str | None, host: HostPrecisions, expected: tuple[str, ...]) -> None:
    assert candidates(requested, host) == expected


def test_a_precision_the_device_cannot_run_is_refused() -> None:
    with pytest.raises(ValueError, match="CPU only"):
        candidates(INT8, GPU)
    with pytest.raises(ValueError, match="GPU only"):
        candidates(FP16, AMX)
    with pytest.raises(ValueError, match="unknown precision"):
        candidates("int4", AMX)


def test_auto_takes_the_fastest_within_the_bound_and_the_margin() -> None:
    choice = choose(AUTO, device="cpu", speedups={FP32: 1.0, BF16: 1.9, INT8: 1.6},
                    quality={BF16: CLOSE, INT8: CLOSE}, policy=POLICY)
    assert (choice.precision, choice.speedup) == (BF16, 1.9)
    assert "bf16 at 1.90x" in choice.reason
    # The fastest misses the bound: the next one runs, and the reason says why bf16 did not.
    choice = choose(AUTO, device="cpu", speedups={FP32: 1.0, BF16: 1.9, INT8: 1.6},
                    quality={BF16: FAR, INT8: CLOSE}, policy=POLICY)
    assert choice.precision == INT8
    assert "bf16 outside the quality bound" in choice.reason


@pytest.mark.parametrize(
    "speedups, quality, expected",
    [
        ({FP32: 1.0, BF16: 1.149}, {BF16: CLOSE}, FP32),  # under the margin
        ({FP32: 1.0, BF16: 1.15}, {BF16: CLOSE}, BF16),  # at the margin
        ({FP32: 1.0, BF16: 3.0}, {BF16: FAR}, FP32),  # fast, but too far from fp32
        ({FP32: 1.0}, {}, FP32),  # nothing offered
        ({}, {}, FP32),  # nothing measured
    ],
)
def test_auto_falls_back_to_fp32(speedups: dict[str, float], quality: dict[str, Quality], expected: str) -> None:
    choice = choose(AUTO, device="cpu", speedups=speedups, quality=quality, policy=POLICY)
    assert choice.precision == expected
    assert not choice.below_margin  # auto never flags: it simply does not run what does not pay


def test_explicit_requests_run_and_are_flagged_when_they_do_not_pay_or_drift() -> None:
    slow = choose(INT8, device="cpu", speedups={FP32: 1.0, INT8: 0.9}, quality={INT8: CLOSE}, policy=POLICY)
    assert (slow.precision, slow.below_margin) == (INT8, True)
    assert "0.90x" in slow.reason and "1.15x" in slow.reason
    far = choose(BF16, device="cpu", speedups={FP32: 1.0, BF16: 2.0}, quality={BF16: FAR}, policy=POLICY)
    assert (far.precision, far.below_margin) == (BF16, True)
    assert "outside the bound" in far.reason
    fine = choose(BF16, device="cpu", speedups={FP32: 1.0, BF16: 2.0}, quality={BF16: CLOSE}, policy=POLICY)
    assert (fine.precision, fine.below_margin, fine.speedup) == (BF16, False, 2.0)
    assert choose(FP32, device="cpu", speedups={}, quality={}, policy=POLICY).precision == FP32
    # A GPU's default is bf16, measured like any explicit request.
    assert choose(None, device="cuda", speedups={FP32: 1.0, BF16: 2.5}, quality={BF16: CLOSE},
                  policy=POLICY).precision == BF16
    with pytest.raises(ValueError):
        choose(AUTO, device="cpu", speedups={}, quality={}, policy=PrecisionPolicy(min_speedup=0.9))


def test_the_quality_bound_has_a_figure_per_kind() -> None:
    bound = QualityBound(min_cosine=0.999, min_label_agreement=0.995, max_probability_error=0.01)
    assert Quality(worst_cosine=0.999).within(bound)
    assert not Quality(worst_cosine=0.9989).within(bound)
    # The probability error is bounded on its mean: one near-tie text's worst error is reported only.
    assert Quality(label_agreement=1.0, mean_probability_error=0.01, worst_probability_error=0.03).within(bound)
    assert not Quality(label_agreement=0.99, mean_probability_error=0.0).within(bound)
    assert not Quality(label_agreement=1.0, mean_probability_error=0.011).within(bound)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeRun:
    """Advances the clock by ``costs[n]`` per text during its n-th pass over the batches."""

    def __init__(self, name: str, costs: Sequence[float], clock: FakeClock, calls: list[str]) -> None:
        self.name, self.costs, self.clock, self.calls = name, costs, clock, calls
        self.passes = -1

    def __call__(self, texts: Sequence[str]) -> object:
        if texts is CALIBRATION_BATCHES[0]:
            self.passes += 1
            self.calls.append(self.name)
        self.clock.now += len(texts) * self.costs[self.passes]
        return None


def test_calibration_measures_rounds_after_an_unmeasured_pass_rotating_the_order() -> None:
    clock, calls = FakeClock(), []
    runs = {FP32: FakeRun(FP32, [1.0] + [0.010] * 3, clock, calls),
            BF16: FakeRun(BF16, [1.0] + [0.005] * 3, clock, calls),
            INT8: FakeRun(INT8, [1.0] + [0.008] * 3, clock, calls)}
    measured = calibrate(runs, rounds=3, clock=clock)
    assert calls == [FP32, BF16, INT8, FP32, BF16, INT8, BF16, INT8, FP32, INT8, FP32, BF16]
    # The first, slow pass of each is left out of every figure.
    assert measured.rounds[BF16] == pytest.approx((2.0,) * 3)
    assert measured.speedups() == pytest.approx({FP32: 1.0, BF16: 2.0, INT8: 1.25})


def test_one_disturbed_round_does_not_move_the_median() -> None:
    clock = FakeClock()
    runs = {FP32: FakeRun(FP32, [0.010] * 6, clock, []),
            # bf16's third measured pass runs ten times slower (a neighbour's burst).
            BF16: FakeRun(BF16, [0.005, 0.005, 0.005, 0.050, 0.005, 0.005], clock, [])}
    measured = calibrate(runs, rounds=5, clock=clock)
    assert measured.rounds[BF16][2] == pytest.approx(0.2)
    assert measured.speedups()[BF16] == pytest.approx(2.0)


def test_a_clock_that_does_not_move_counts_as_equal_speed_and_fp32_is_required() -> None:
    clock, frozen = FakeClock(), FakeClock()
    runs = {FP32: FakeRun(FP32, [0.01] * 4, clock, []), BF16: FakeRun(BF16, [0.01] * 4, clock, [])}
    assert calibrate(runs, rounds=1, clock=frozen).speedups() == {FP32: 1.0, BF16: 1.0}
    with pytest.raises(ValueError):
        calibrate(runs, rounds=0, clock=clock)
    with pytest.raises(ValueError, match="fp32"):
        calibrate({BF16: runs[BF16]}, rounds=1, clock=clock)


def test_a_model_that_declares_its_precisions_is_offered_only_those() -> None:
    assert candidates(AUTO, AMX, (BF16,)) == (FP32, BF16)
    assert candidates(AUTO, GPU, (BF16,)) == (FP32, BF16)
    assert candidates(AUTO, AMX, ()) == (FP32,)
    assert candidates(BF16, AMX, (BF16,)) == (FP32, BF16)
    with pytest.raises(ValueError, match="runs bf16, fp32, not int8"):
        candidates(INT8, AMX, (BF16,))
