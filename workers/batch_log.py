"""What a worker logs of the batches it stores: a line per batch where someone follows its jobs,
a summary a minute otherwise (docs/ARCHITECTURE.md, "Logs").

A line per batch at single-job rates is a line per job: its formatting and writing cost the
worker more CPU than the batching saves. The metrics count every batch (sizes, close reasons,
fill time), so the log keeps what only it can give: the batches that hold a job whose request id
the caller chose (`X-Request-Id`, or a batch's rows under the batch's id), at INFO with their
`job_ids` and `request_ids`; every other batch at DEBUG with the same fields; and at INFO, at most
once per `summary_every_s`, how many batches and jobs were stored since the last summary and why
their batches closed. A failed job gets a warning of its own. Never inputs or outputs.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sluice.logs import is_generated_request_id
from workers.results import Delivery

log = logging.getLogger("workers.worker")

SUMMARY_EVERY_S = 60.0


class BatchLog:
    def __init__(self, *, model: str, version: str, summary_every_s: float = SUMMARY_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.model = model
        self.version = version
        self.summary_every_s = summary_every_s
        self._clock = clock
        self._since = clock()
        self._batches = 0
        self._jobs = 0
        self._reasons: Counter[str] = Counter()

    def failed(self, jobs: Sequence[tuple[Delivery, Mapping[str, Any]]]) -> None:
        """A warning per job that failed, with its error (already scrubbed of the input)."""
        for job, error in jobs:
            log.warning("job %s failed: %s", job.job_id, error.get("message", ""), extra={
                "job_id": job.job_id, "request_id": job.request_id, "error_code": error.get("code")})

    def stored(self, *, lane: str, close_reason: str, model_ms: float, job_ids: Sequence[str],
               request_ids: Sequence[str | None]) -> None:
        named = sorted({rid for rid in request_ids if rid})
        followed = any(not is_generated_request_id(rid) for rid in named)
        level = logging.INFO if followed else logging.DEBUG
        if log.isEnabledFor(level):
            log.log(level, "batch of %d stored (%s lane, closed on %s) after %.1f ms on the model", len(job_ids),
                    lane, close_reason, model_ms, extra={
                        "model": self.model, "version": self.version, "lane": lane, "batch_size": len(job_ids),
                        "close_reason": close_reason, "model_ms": model_ms, "job_ids": list(job_ids),
                        "request_ids": named})
        self._batches += 1
        self._jobs += len(job_ids)
        self._reasons[close_reason] += 1
        now = self._clock()
        if now - self._since >= self.summary_every_s:
            reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(self._reasons.items()))
            log.info("%d batches of %d jobs stored in the last %.0f s (closed on %s)", self._batches, self._jobs,
                     now - self._since, reasons, extra={
                         "model": self.model, "version": self.version, "batches": self._batches,
                         "jobs": self._jobs, "close_reasons": dict(self._reasons)})
            self._since, self._batches, self._jobs = now, 0, 0
            self._reasons.clear()
