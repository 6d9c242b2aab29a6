"""Running a batch on a handler so that one bad input fails alone.

When a batch raises, it is split in halves and each half retried, recursively, so a single
poison input costs about log2(batch) extra calls and every other input still succeeds.

An input that still raises on its own fails for good only when the handler says the input is bad
(InferenceError, the handler contract): running it again elsewhere would fail the same way. Any
other exception is the worker's failure (a handler bug, a lost device), not the input's: the job
gets no outcome here and is left for another delivery, and if every delivery ends so, its dead
letter carries this message.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sluice.errors import InferenceError
from sluice.redact import scrub
from sluice.references import Written
from workers.models.protocol import ModelHandler

log = logging.getLogger(__name__)

# Input strings shorter than this are left in a fault message: they would match its own words.
_REDACTED_MIN_CHARS = 4


@dataclass(frozen=True, slots=True)
class Outcome:
    """One input's result: an output, an error (final), or a fault (no outcome: the job is left
    for another delivery, and the fault is the error its dead letter will carry)."""

    output: dict[str, Any] | None = None
    error: dict[str, str] | None = None
    fault: str | None = None
    # The handler's own quality proxies of the output (a handler class's `quality`), if it has any.
    proxies: dict[str, Any] | None = None
    # Set when the output went to the job's output_uri (workers/references.py): stored instead of it.
    written: Written | None = None


def _error_body(exc: BaseException) -> dict[str, str]:
    # The message may quote the input: scrub it before it is stored or logged.
    return {"code": "inference_error", "message": scrub(f"{type(exc).__name__}: {exc}")[:500]}


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _strings(item)


def fault_message(exc: BaseException, item: Mapping[str, Any]) -> str:
    """The exception as an operator may read it in a dead letter: the input's own text taken out."""
    message = f"{type(exc).__name__}: {exc}"
    for text in sorted(set(_strings(item)), key=len, reverse=True):
        if len(text) >= _REDACTED_MIN_CHARS:
            message = message.replace(text, "[input]")
    return scrub(message)[:500]


def _alone(exc: Exception, item: Mapping[str, Any]) -> Outcome:
    if isinstance(exc, InferenceError):
        # Logged by the worker once stored, with the job's id and request id.
        return Outcome(error=_error_body(exc))
    fault = fault_message(exc, item)
    log.warning("a run failed on the worker's side; its job is left for another delivery: %s", fault)
    return Outcome(fault=fault)


def _bisect(handler: ModelHandler, inputs: Sequence[Mapping[str, Any]]) -> list[Outcome]:
    try:
        outputs = handler.run(inputs)
        if len(outputs) != len(inputs):
            raise RuntimeError(f"handler answered {len(outputs)} outputs for {len(inputs)} inputs")
    except Exception as exc:
        if len(inputs) == 1:
            return [_alone(exc, inputs[0])]
        middle = len(inputs) // 2
        return _bisect(handler, inputs[:middle]) + _bisect(handler, inputs[middle:])
    return [Outcome(output=output, proxies=handler.proxies(output)) for output in outputs]


def timed_out(size: int, timeout_s: float) -> list[Outcome]:
    """The outcomes of a batch that ran past its timeout: each of its jobs failed, none retried
    (the input may be what hangs the model)."""
    error = {"code": "handler_timeout",
             "message": f"the model ran past the {timeout_s:g} s per-batch timeout on a batch of {size}"}
    return [Outcome(error=error) for _ in range(size)]


def run_timed_out(limit_s: float) -> Outcome:
    """The outcome of a job whose batch ran past the job's own `run_timeout_s`."""
    return Outcome(error={"code": "run_timeout",
                          "message": f"the batch holding this job ran past its run_timeout_s of {limit_s:g} s"})


def run_isolating(handler: ModelHandler, inputs: Sequence[Mapping[str, Any]]) -> tuple[list[Outcome], float]:
    """Run a batch; answer one outcome per input and the model seconds spent."""
    start = time.perf_counter()
    outcomes = _bisect(handler, inputs)
    return outcomes, time.perf_counter() - start
