"""Which precision a MiniLM version runs on this host: fp32, or int8 where int8 pays.

An artifact asks with ``?quantize=``: ``fp32`` (the same as no option), ``int8`` or ``auto``.
``fp32`` and ``int8`` are honoured on every host. ``auto`` runs int8 only where both hold:

* the CPU takes 8-bit activations (VNNI). Elsewhere the kernel needs 7-bit ones, whose vectors
  sit about three times further from fp32's, so ``auto`` would serve outputs nobody validated;
* a calibration at start-up measures int8 at least ``min_speedup`` times as fast as fp32.

The calibration times both encoders on the same batches, shaped like the skewed mix at the
worker's usual batch sizes, in CPU time of the process: a shared host takes wall time away from
a process but hardly changes the CPU it needs per batch. An explicit ``int8`` is measured too,
so a worker that runs it where it does not pay says so. Nothing here imports torch.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from sluice.settings import Settings

FP32 = "fp32"
INT8 = "int8"
AUTO = "auto"

# The defaults of `SLUICE_INT8_MIN_SPEEDUP` and `SLUICE_INT8_CALIBRATION_ROUNDS`, for callers
# that build no Settings (tests, benches).
DEFAULT_MIN_SPEEDUP: float = Settings.model_fields["int8_min_speedup"].default
DEFAULT_ROUNDS: int = Settings.model_fields["int8_calibration_rounds"].default

# 80 % short and 20 % long texts, like the skewed mix, in batches of the sizes a worker forms
# at saturation (mean 7-11 jobs). 16 and 142 MiniLM tokens.
_SHORT = "where is my order and when will the parcel finally arrive at my door"
_LONG = "please help me understand why my card payment was declined at the store today " * 10
CALIBRATION_BATCHES: tuple[tuple[str, ...], ...] = ((_SHORT,) * 12, (_LONG,) * 3)


class Encoder(Protocol):
    def encode(self, texts: Sequence[str]) -> object: ...


@dataclass(frozen=True, slots=True)
class Calibration:
    """int8 against fp32 on the calibration batches: per measured round, fp32's CPU time over
    int8's (above 1: int8 is faster), and the totals of every measured round."""

    speedups: tuple[float, ...]
    fp32_cpu_s: float
    int8_cpu_s: float
    fp32_wall_s: float
    int8_wall_s: float

    @property
    def speedup(self) -> float:
        # The median: one round disturbed by a neighbour's burst does not move it.
        return statistics.median(self.speedups)

    @property
    def wall_speedup(self) -> float:
        return self.fp32_wall_s / self.int8_wall_s if self.fp32_wall_s > 0 and self.int8_wall_s > 0 else 1.0


@dataclass(frozen=True, slots=True)
class PrecisionPolicy:
    """How ``auto`` decides: the speed-up int8 must reach, and the calibration's measured rounds."""

    min_speedup: float = DEFAULT_MIN_SPEEDUP
    rounds: int = DEFAULT_ROUNDS


@dataclass(frozen=True, slots=True)
class PrecisionChoice:
    requested: str  # fp32, int8 or auto
    precision: str  # what runs: fp32 or int8 (bf16 on a GPU)
    speedup: float | None  # int8's measured speed over fp32's (CPU time); None when not measured
    reason: str
    # An explicit int8 measured below the margin here: it runs, and the worker warns.
    below_margin: bool = False


def needs_calibration(requested: str, *, eight_bit: bool) -> bool:
    """Whether the choice needs int8's speed measured on this host."""
    return requested == INT8 or (requested == AUTO and eight_bit)


def choose(
    requested: str | None, *, eight_bit: bool, speedup: float | None, min_speedup: float = DEFAULT_MIN_SPEEDUP
) -> PrecisionChoice:
    """The precision a CPU worker runs, given what the artifact asked for, whether the CPU takes
    8-bit activations, and int8's measured speed-up (None when not measured)."""
    if min_speedup < 1.0:
        raise ValueError(f"min_speedup must be >= 1, got {min_speedup}")
    requested = requested or FP32
    measured = "not measured" if speedup is None else f"{speedup:.2f}x fp32"
    if requested == FP32:
        return PrecisionChoice(requested, FP32, speedup, "asked for fp32")
    if requested == INT8:
        below = speedup is not None and speedup < min_speedup
        reason = f"asked for int8 ({measured}" + (f", below the {min_speedup:.2f}x that auto needs)" if below else ")")
        return PrecisionChoice(requested, INT8, speedup, reason, below_margin=below)
    if requested != AUTO:
        raise ValueError(f"unknown precision request {requested!r}; expected {FP32}, {INT8} or {AUTO}")
    if not eight_bit:
        return PrecisionChoice(requested, FP32, speedup, "auto: this CPU gives int8 only 7-bit activations (no VNNI)")
    if speedup is None or speedup < min_speedup:
        return PrecisionChoice(requested, FP32, speedup, f"auto: int8 {measured}, under the {min_speedup:.2f}x margin")
    return PrecisionChoice(requested, INT8, speedup, f"auto: int8 {measured}, at least the {min_speedup:.2f}x margin")


def calibrate(
    fp32: Encoder,
    int8: Encoder,
    *,
    rounds: int = DEFAULT_ROUNDS,
    batches: Sequence[Sequence[str]] = CALIBRATION_BATCHES,
    cpu_clock: Callable[[], float] = time.process_time,
    wall_clock: Callable[[], float] = time.perf_counter,
) -> Calibration:
    """Time both encoders on ``batches``: one unmeasured pass each (first-call allocations),
    then ``rounds`` rounds, the order alternating so a drift of the host's speed falls on both."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")

    def timed(encoder: Encoder) -> tuple[float, float]:
        cpu, wall = cpu_clock(), wall_clock()
        for batch in batches:
            encoder.encode(batch)
        return cpu_clock() - cpu, wall_clock() - wall

    timed(fp32)
    timed(int8)
    speedups: list[float] = []
    totals = [0.0, 0.0, 0.0, 0.0]  # fp32 CPU, int8 CPU, fp32 wall, int8 wall
    for i in range(rounds):
        if i % 2:
            int8_cpu, int8_wall = timed(int8)
            fp32_cpu, fp32_wall = timed(fp32)
        else:
            fp32_cpu, fp32_wall = timed(fp32)
            int8_cpu, int8_wall = timed(int8)
        # A clock too coarse to see a pass (a fake one, or a tick-based one) counts as equal speed.
        speedups.append(fp32_cpu / int8_cpu if int8_cpu > 0 and fp32_cpu > 0 else 1.0)
        for j, value in enumerate((fp32_cpu, int8_cpu, fp32_wall, int8_wall)):
            totals[j] += value
    return Calibration(
        speedups=tuple(speedups),
        fp32_cpu_s=totals[0],
        int8_cpu_s=totals[1],
        fp32_wall_s=totals[2],
        int8_wall_s=totals[3],
    )
