"""A job's own retry policy (`retry` at submit): which failures re-queue it, and how often.

The words a client lists name kinds of failure, not error codes: `worker_error` is a run that
ended without an outcome (a handler fault or a dead worker: `sluice.wire.lua.claim`), `timeout`
a batch past the operator's per-batch timeout (code `handler_timeout`), `run_timeout` one past
the job's own `run_timeout_s` (code `run_timeout`). An input the model refuses
(`inference_error`) is never retried: it would fail the same way.

`attempts` counts a job's starts, whatever ended them, so `max_attempts` bounds every start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, cast, get_args

RetryOn = Literal["worker_error", "timeout", "run_timeout"]
RETRY_ON: tuple[RetryOn, ...] = get_args(RetryOn)
WORKER_ERROR: RetryOn = "worker_error"

# The error code a finished attempt carries, for the words that name one (a worker error leaves no
# outcome: claim.lua counts those, by the word itself).
_CODES: dict[str, RetryOn] = {"handler_timeout": "timeout", "run_timeout": "run_timeout"}


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_attempts: int
    on: tuple[RetryOn, ...]

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")
        unknown = set(self.on) - set(RETRY_ON)
        if unknown:
            raise ValueError(f"retry.on names unknown failures: {sorted(unknown)}")

    def requeues(self, *, error_code: str | None, attempts: int) -> bool:
        """Whether an attempt, the `attempts`-th start, that ended with `error_code` goes back to
        the queue rather than failing the job."""
        word = _CODES.get(error_code or "")
        return word is not None and word in self.on and attempts < self.max_attempts

    def encode(self) -> str:
        """The policy as the job record and the stream entry carry it: `3:timeout,run_timeout`."""
        return f"{self.max_attempts}:{','.join(self.on)}"

    @classmethod
    def parse(cls, text: str | None) -> RetryPolicy | None:
        if not text:
            return None
        count, _, words = text.partition(":")
        return cls(max_attempts=int(count), on=cast(tuple[RetryOn, ...], tuple(w for w in words.split(",") if w)))
