"""Running a batch on a handler so that one bad input fails alone.

When a batch raises, it is split in halves and each half retried, recursively, so a single
poison input costs about log2(batch) extra calls and every other input still succeeds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sluice.redact import scrub
from workers.models.handlers import ModelHandler

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Outcome:
    output: dict[str, Any] | None = None
    error: dict[str, str] | None = None


def _error_body(exc: BaseException) -> dict[str, str]:
    # The message may quote the input: scrub it before it is stored or logged.
    return {"code": "inference_error", "message": scrub(f"{type(exc).__name__}: {exc}")[:500]}


def _bisect(handler: ModelHandler, inputs: Sequence[Mapping[str, Any]]) -> list[Outcome]:
    try:
        outputs = handler.run(inputs)
    except Exception as exc:
        if len(inputs) == 1:
            log.warning("an input failed on its own: %s", _error_body(exc)["message"])
            return [Outcome(error=_error_body(exc))]
        middle = len(inputs) // 2
        return _bisect(handler, inputs[:middle]) + _bisect(handler, inputs[middle:])
    if len(outputs) != len(inputs):
        raise RuntimeError(f"handler answered {len(outputs)} outputs for {len(inputs)} inputs")
    return [Outcome(output=output) for output in outputs]


def run_isolating(handler: ModelHandler, inputs: Sequence[Mapping[str, Any]]) -> tuple[list[Outcome], float]:
    """Run a batch; answer one outcome per input and the model seconds spent."""
    start = time.perf_counter()
    outcomes = _bisect(handler, inputs)
    return outcomes, time.perf_counter() - start
