"""Which precision a version runs on this host: the fastest that stays close enough to fp32.

An artifact asks with ``?precision=`` (``?quantize=`` is the older spelling of the same option):
``fp32``, ``bf16``, ``fp16``, ``int8`` or ``auto``. An explicit precision is honoured wherever the
device can run it at all (int8 only on the CPU); it is measured too, so a worker that runs one
that does not pay, or that misses the quality bound, says so. With no option a version runs fp32
on the CPU and bf16 on a GPU, as it always has.

``auto`` weighs the candidates this host offers (:func:`candidates`): on the CPU bf16 where the
CPU has AVX512-BF16 or AMX, and int8 where it takes 8-bit activations (VNNI; elsewhere the kernel
needs 7-bit ones, whose outputs sit three times further from fp32's); on a GPU bf16 where the GPU
supports it, and fp16. A calibration at start-up times each candidate against fp32 on the same
batches, shaped like the skewed mix at the worker's usual batch sizes, in the process's CPU time
on the CPU (a shared host takes wall time away from a process but hardly changes the CPU it needs)
and in wall time on a GPU; and compares its outputs with fp32's on the calibration texts
(:class:`QualityBound`). The fastest candidate within the bound and at least ``min_speedup``
times fp32's speed runs; fp32 otherwise. Nothing here imports torch: the models are built and run
by ``workers/models/calibration.py``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sluice.artifacts import PRECISION_MODES
from sluice.settings import Settings

FP32 = "fp32"
BF16 = "bf16"
FP16 = "fp16"
INT8 = "int8"
AUTO = "auto"
PRECISIONS = tuple(mode for mode in PRECISION_MODES if mode != AUTO)

# The defaults of the `SLUICE_PRECISION_*` settings, for callers that build no Settings (tests, benches).
DEFAULT_MIN_SPEEDUP: float = Settings.model_fields["precision_min_speedup"].default
DEFAULT_ROUNDS: int = Settings.model_fields["precision_calibration_rounds"].default
DEFAULT_MIN_COSINE: float = Settings.model_fields["precision_min_cosine"].default
DEFAULT_MIN_LABEL_AGREEMENT: float = Settings.model_fields["precision_min_label_agreement"].default
DEFAULT_MAX_PROBABILITY_ERROR: float = Settings.model_fields["precision_max_probability_error"].default

# 80 % short and 20 % long texts, like the skewed mix, in batches of the sizes a worker forms
# at saturation (mean 7-11 jobs). 16 and 142 MiniLM tokens.
_SHORT = "where is my order and when will the parcel finally arrive at my door"
_LONG = "please help me understand why my card payment was declined at the store today " * 10
CALIBRATION_BATCHES: tuple[tuple[str, ...], ...] = ((_SHORT,) * 12, (_LONG,) * 3)
# A GPU's batches are larger, and a small one measures kernel launches and the CPU's share of a
# batch, which every precision pays alike: on an H200 batches of 12 and 3 timed bf16 at 0.7x fp32,
# batches of 128 and 32 at 1.05x, while the worker ran batches of 256 of the mix 1.3x faster.
GPU_CALIBRATION_BATCHES: tuple[tuple[str, ...], ...] = ((_SHORT,) * 256, (_LONG,) * 64)


@dataclass(frozen=True, slots=True)
class HostPrecisions:
    """What the device the version runs on can do fast."""

    device: str  # "cpu" or "cuda"
    bf16: bool  # CPU: AVX512-BF16 or AMX; GPU: bf16 supported
    int8: bool  # CPU only: 8-bit activations (VNNI)


@dataclass(frozen=True, slots=True)
class QualityBound:
    """How close to fp32 a precision must stay on the calibration texts."""

    min_cosine: float = DEFAULT_MIN_COSINE  # embeddings: the worst text's cosine to fp32
    min_label_agreement: float = DEFAULT_MIN_LABEL_AGREEMENT  # classifiers: share of equal top labels
    # Classifiers: the ceiling on fp32's top probability's error, averaged over the texts (a single
    # near-tie text moves by a few hundredths in bf16 even where every label agrees).
    max_probability_error: float = DEFAULT_MAX_PROBABILITY_ERROR


@dataclass(frozen=True, slots=True)
class Quality:
    """A precision's outputs against fp32's on the calibration texts; a figure is None where the
    kind has no such output."""

    worst_cosine: float | None = None
    label_agreement: float | None = None
    mean_probability_error: float | None = None
    worst_probability_error: float | None = None  # reported, not bounded

    def within(self, bound: QualityBound) -> bool:
        return ((self.worst_cosine is None or self.worst_cosine >= bound.min_cosine)
                and (self.label_agreement is None or self.label_agreement >= bound.min_label_agreement)
                and (self.mean_probability_error is None
                     or self.mean_probability_error <= bound.max_probability_error))

    def describe(self) -> str:
        parts = [f"worst cosine {self.worst_cosine:.5f}" if self.worst_cosine is not None else "",
                 f"labels agree {self.label_agreement:.2%}" if self.label_agreement is not None else "",
                 f"top-probability error {self.mean_probability_error:.4f} mean, "
                 f"{self.worst_probability_error or 0.0:.4f} worst" if self.mean_probability_error is not None else ""]
        return ", ".join(part for part in parts if part) or "no outputs compared"


@dataclass(frozen=True, slots=True)
class PrecisionPolicy:
    """How ``auto`` decides: the speed-up a candidate must reach, the calibration's measured
    rounds, and the quality bound."""

    min_speedup: float = DEFAULT_MIN_SPEEDUP
    rounds: int = DEFAULT_ROUNDS
    bound: QualityBound = field(default_factory=QualityBound)

    @classmethod
    def from_settings(cls, settings: Settings) -> PrecisionPolicy:
        return cls(min_speedup=settings.precision_min_speedup, rounds=settings.precision_calibration_rounds,
                   bound=QualityBound(min_cosine=settings.precision_min_cosine,
                                      min_label_agreement=settings.precision_min_label_agreement,
                                      max_probability_error=settings.precision_max_probability_error))

    def key(self) -> str:
        """What a cached choice depends on beyond the artifact and the request."""
        return (f"{self.min_speedup}/{self.rounds}/{self.bound.min_cosine}/{self.bound.min_label_agreement}/"
                f"{self.bound.max_probability_error}")


@dataclass(frozen=True, slots=True)
class PrecisionChoice:
    requested: str  # what the artifact asked for: a precision, or auto
    precision: str  # what runs
    speedup: float | None  # its measured speed over fp32's; None when nothing was measured
    reason: str
    # An explicit request that runs although it measured below the margin or outside the bound.
    below_margin: bool = False
    # Every candidate's measured speed over fp32's, for the log and the bench.
    measured: Mapping[str, float] = field(default_factory=dict)


def default_precision(device: str) -> str:
    """What a version with no precision option runs."""
    return BF16 if device == "cuda" else FP32


def candidates(requested: str | None, host: HostPrecisions,
               supported: tuple[str, ...] = PRECISIONS) -> tuple[str, ...]:
    """The precisions to build and measure for ``requested`` on ``host``, fp32 first; a single one
    means there is nothing to measure. ``supported`` is what the model can run at all (a handler
    class declares its own). Raises ValueError for what the device or the model cannot run."""
    requested = requested or default_precision(host.device)
    if requested not in PRECISION_MODES:
        raise ValueError(f"unknown precision {requested!r}; expected one of {', '.join(PRECISION_MODES)}")
    if requested not in (FP32, AUTO, *supported):
        raise ValueError(f"the model runs {', '.join(sorted({FP32, *supported}))}, not {requested}")
    if requested == INT8 and host.device != "cpu":
        raise ValueError(f"int8 runs on the CPU only, not on {host.device}")
    if requested == FP16 and host.device == "cpu":
        raise ValueError("fp16 runs on a GPU only; the CPU's half precision is bf16")
    if requested != AUTO:
        return (FP32,) if requested == FP32 else (FP32, requested)
    if host.device == "cpu":
        offered = (FP32, *((BF16,) if host.bf16 else ()), *((INT8,) if host.int8 else ()))
    else:
        offered = (FP32, *((BF16,) if host.bf16 else ()), FP16)
    return tuple(name for name in offered if name == FP32 or name in supported)


def choose(requested: str | None, *, device: str, speedups: Mapping[str, float], quality: Mapping[str, Quality],
           policy: PrecisionPolicy) -> PrecisionChoice:
    """The precision that runs, given what was asked, each measured candidate's speed over fp32
    and its quality; ``speedups`` is empty when nothing was measured."""
    if policy.min_speedup < 1.0:
        raise ValueError(f"min_speedup must be >= 1, got {policy.min_speedup}")
    requested = requested or default_precision(device)
    measured = dict(speedups)
    if requested != AUTO:
        speedup = measured.get(requested)
        if requested == FP32:
            return PrecisionChoice(requested, FP32, None, "asked for fp32", measured=measured)
        if speedup is None:
            return PrecisionChoice(requested, requested, None, f"asked for {requested} (not measured)",
                                   measured=measured)
        slow = speedup < policy.min_speedup
        off = requested in quality and not quality[requested].within(policy.bound)
        notes = [f"{speedup:.2f}x fp32"]
        if slow:
            notes.append(f"below the {policy.min_speedup:.2f}x that auto needs")
        if requested in quality:
            notes.append(quality[requested].describe() + (", outside the bound" if off else ""))
        return PrecisionChoice(requested, requested, speedup, f"asked for {requested} ({'; '.join(notes)})",
                               below_margin=slow or off, measured=measured)
    rejected: list[str] = []
    best: tuple[float, str] | None = None
    for name, speedup in measured.items():
        if name == FP32:
            continue
        if name in quality and not quality[name].within(policy.bound):
            rejected.append(f"{name} outside the quality bound ({quality[name].describe()})")
        elif speedup < policy.min_speedup:
            rejected.append(f"{name} {speedup:.2f}x, under the {policy.min_speedup:.2f}x margin")
        elif best is None or speedup > best[0]:
            best = (speedup, name)
    if best is None:
        why = "; ".join(rejected) or "no faster precision on this host"
        return PrecisionChoice(AUTO, FP32, None, f"auto: fp32 ({why})", measured=measured)
    speedup, name = best
    detail = f", {quality[name].describe()}" if name in quality else ""
    others = "".join(f"; {reason}" for reason in rejected)
    return PrecisionChoice(AUTO, name, speedup, f"auto: {name} at {speedup:.2f}x fp32{detail}{others}",
                           measured=measured)


@dataclass(frozen=True, slots=True)
class Calibration:
    """Each candidate against fp32 on the calibration batches: per measured round, fp32's time
    over the candidate's (above 1: the candidate is faster)."""

    rounds: Mapping[str, tuple[float, ...]]

    def speedups(self) -> dict[str, float]:
        # The median: one round disturbed by a neighbour's burst does not move it.
        return {name: statistics.median(ratios) for name, ratios in self.rounds.items()}


def calibrate(runs: Mapping[str, Callable[[Sequence[Any]], object]], *, rounds: int = DEFAULT_ROUNDS,
              batches: Sequence[Sequence[Any]] = CALIBRATION_BATCHES,
              clock: Callable[[], float] = time.process_time) -> Calibration:
    """Time every run (fp32 among them) on ``batches``: one unmeasured pass each (first-call
    allocations), then ``rounds`` rounds, the order rotating so a drift of the host's speed falls
    on all of them."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if FP32 not in runs:
        raise ValueError("the calibration measures against fp32, which is missing")

    def timed(run: Callable[[Sequence[Any]], object]) -> float:
        started = clock()
        for batch in batches:
            run(batch)
        return clock() - started

    names = list(runs)
    for name in names:
        timed(runs[name])
    ratios: dict[str, list[float]] = {name: [] for name in names}
    for i in range(rounds):
        order = names[i % len(names):] + names[:i % len(names)]
        spent = {name: timed(runs[name]) for name in order}
        for name in names:
            # A clock too coarse to see a pass (a fake one, or a tick-based one) counts as equal speed.
            ratio = spent[FP32] / spent[name] if spent[name] > 0 and spent[FP32] > 0 else 1.0
            ratios[name].append(ratio)
    return Calibration(rounds={name: tuple(values) for name, values in ratios.items()})
