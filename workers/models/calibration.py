"""The start-up calibration's torch side: what this host offers, each candidate built and compared
with fp32, and the one `workers.models.precision.choose` picks kept (the rule and its reasons
live there; docs/ARCHITECTURE.md, "Precision per host").
"""

from __future__ import annotations

import ctypes
import functools
import gc
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
import torch.nn.functional as F

from workers.models.int8 import needs_reduce_range
from workers.models.minilm import MiniLMEncoder
from workers.models.pass_cost import SHAPES, fit_overhead_tokens
from workers.models.precision import (
    BF16,
    CALIBRATION_BATCHES,
    FP16,
    FP32,
    GPU_CALIBRATION_BATCHES,
    PRECISIONS,
    HostPrecisions,
    PrecisionChoice,
    PrecisionPolicy,
    Quality,
    calibrate,
    candidates,
    choose,
)

log = logging.getLogger(__name__)

Model = TypeVar("Model")

# What each candidate's outputs are compared with fp32's on: requests of many kinds and lengths,
# none of them a text the int8 smoothing is calibrated on (workers/models/int8.py), so int8 is
# judged on texts it has not seen.
_SENTENCES = (
    "Where is my parcel? The tracking page has said 'out for delivery' since Tuesday.",
    "I was charged twice for the same order, can you refund one of the payments?",
    "How many vacation days do new employees get in their first year?",
    "Translate 'good morning' into Spanish and French.",
    "The hotel room was clean but the air conditioning did not work at all.",
    "Please change the delivery address on order 58121 to my office.",
    "What are the side effects of taking ibuprofen with coffee?",
    "Our build fails with a segmentation fault when the cache directory is missing.",
    "Book a table for four at seven tonight, somewhere quiet.",
    "The committee postponed the vote until the budget figures are audited.",
    "hi",
    "cancel it",
    "Is the blue jacket available in a medium size in the Leeds store?",
    "My daughter's school bus is late again; who should I call about it?",
    "Rain is expected across the north with temperatures falling below freezing overnight.",
    "Can I pay with a card that is registered to a different address?",
)
QUALITY_TEXTS: tuple[str, ...] = (
    *_SENTENCES,
    " ".join(_SENTENCES[:8]) * 2,
    " ".join(reversed(_SENTENCES)),
    " ".join(_SENTENCES[1::2] * 3),
    " ".join(_SENTENCES[::3] * 2),
)

DTYPES = {FP32: torch.float32, BF16: torch.bfloat16, FP16: torch.float16}


def torch_dtype(precision: str) -> torch.dtype:
    """The dtype a precision's weights and activations are held in; int8 keeps float32 around its kernels."""
    return DTYPES.get(precision, torch.float32)


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def host_precisions(device: str) -> HostPrecisions:
    if torch.device(device).type == "cuda":
        return HostPrecisions(device="cuda", bf16=torch.cuda.is_bf16_supported(), int8=False)
    flags = cpu_flags()
    return HostPrecisions(device="cpu", bf16=bool(flags & {"avx512_bf16", "amx_bf16"}), int8=not needs_reduce_range())


def embedding_quality(reference: torch.Tensor, outputs: torch.Tensor) -> Quality:
    """The worst text's cosine between its fp32 vector and the candidate's."""
    cosines = F.cosine_similarity(reference.to(torch.float32), outputs.to(torch.float32), dim=-1)
    return Quality(worst_cosine=float(cosines.min()))


def classifier_quality(reference: torch.Tensor, outputs: torch.Tensor) -> Quality:
    """Of probability rows: the share of texts whose top label is fp32's, and the error of fp32's
    top probability, its mean and its worst."""
    reference, outputs = reference.to(torch.float32), outputs.to(torch.float32)
    top = reference.argmax(dim=-1)
    agreement = float((outputs.argmax(dim=-1) == top).to(torch.float32).mean())
    errors = (outputs.gather(-1, top[:, None]) - reference.gather(-1, top[:, None])).abs()
    return Quality(label_agreement=agreement, mean_probability_error=float(errors.mean()),
                   worst_probability_error=float(errors.max()))


@torch.inference_mode()
def head_quality(head: torch.nn.Module, reference: torch.Tensor, encoder: MiniLMEncoder) -> Quality:
    """A classifier head's probabilities over the encoder's vectors against those over fp32's."""
    def probabilities(vectors: torch.Tensor) -> torch.Tensor:
        return torch.softmax(head(vectors.to(torch.float32)), dim=-1)

    return classifier_quality(probabilities(reference), probabilities(encoder.encode(QUALITY_TEXTS)))


@dataclass(frozen=True, slots=True)
class Selected(Generic[Model]):
    model: Model
    choice: PrecisionChoice
    # fp32's outputs on QUALITY_TEXTS, kept so a head over a shared encoder can check its own bound
    # without an fp32 copy; None when only one precision was built.
    reference: torch.Tensor | None


def select_precision(requested: str | None, *, device: str, policy: PrecisionPolicy,
                     build: Callable[[str], Model], outputs: Callable[[Model, Sequence[Any]], torch.Tensor],
                     compare: Callable[[torch.Tensor, torch.Tensor], Quality],
                     supported: tuple[str, ...] = PRECISIONS,
                     inputs: Callable[[Model], Sequence[Any]] | None = None) -> Selected[Model]:
    """Build ``requested`` on ``device`` (and, where there is a choice to measure, fp32 and every
    candidate beside it), and keep the one the rule picks. The text kinds are compared on
    QUALITY_TEXTS and timed on the calibration batches; a handler class gives its own ``inputs``
    (read off its fp32 copy), compared and timed as one batch. Raises ValueError for a precision
    the device or the model cannot run."""
    host = host_precisions(device)
    names = candidates(requested, host, supported)
    if len(names) == 1:
        only = names[0]
        return Selected(build(only), choose(requested, device=host.device, speedups={}, quality={}, policy=policy),
                        None)
    started = time.process_time()
    models = {name: build(name) for name in names}
    own = list(inputs(models[FP32])) if inputs is not None else None
    compared: Sequence[Any] = own if own is not None else QUALITY_TEXTS
    reference = outputs(models[FP32], compared)
    quality = {name: compare(reference, outputs(models[name], compared)) for name in names if name != FP32}
    # A GPU works asynchronously: its passes are timed by the wall clock (each ends in a copy to the CPU).
    clock = time.process_time if host.device == "cpu" else time.perf_counter
    batches: Sequence[Sequence[Any]] = (
        (own,) if own is not None else CALIBRATION_BATCHES if host.device == "cpu" else GPU_CALIBRATION_BATCHES)
    runs = {name: functools.partial(outputs, model) for name, model in models.items()}
    measured = calibrate(runs, rounds=policy.rounds, batches=batches, clock=clock).speedups()
    choice = choose(requested, device=host.device, speedups=measured, quality=quality, policy=policy)
    log.info("precision calibration on %s: %s; %.2f s of CPU", host.device,
             ", ".join(f"{name} {measured[name]:.2f}x" + (f" ({quality[name].describe()})" if name in quality else "")
                       for name in names), time.process_time() - started)
    if choice.below_margin:
        log.warning("running %s as the artifact asks, though it does not pay or stay close to fp32 here: %s",
                    choice.precision, choice.reason)
    kept = models.pop(choice.precision)
    models.clear()
    release_freed_memory()
    return Selected(kept, choice, reference)


@torch.inference_mode()
def measure_pass_overhead(encoder: MiniLMEncoder, *, rounds: int,
                          clock: Callable[[], float] = time.process_time) -> int | None:
    """The fixed cost of one of the encoder's forward passes on this host, in tokens' worth
    (`workers.models.pass_cost`): each shape of `SHAPES` timed `rounds` times, in rotating order."""
    inputs = {(texts, width): (torch.full((texts, width), 1000, dtype=torch.long),
                               torch.ones((texts, width), dtype=torch.long),
                               torch.zeros((texts, width), dtype=torch.long))
              for texts, width in SHAPES}
    for shape in SHAPES:
        encoder.forward_pooled(*inputs[shape])  # the first pass of a shape pays for its allocations
    timings: dict[tuple[int, int], list[float]] = {shape: [] for shape in SHAPES}
    for turn in range(rounds):
        for shape in SHAPES[turn % len(SHAPES):] + SHAPES[:turn % len(SHAPES)]:
            started = clock()
            encoder.forward_pooled(*inputs[shape])
            timings[shape].append(clock() - started)
    return fit_overhead_tokens(timings)


def release_freed_memory() -> None:
    """Free the losing copies' tensors now, and hand the heap pages they held back to the system:
    the worker measures its footprint next, and the placement budgets memory with it."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: the pages stay with the allocator for the next load
