"""A worker's Prometheus series: the labelled children of `sluice.metrics`, looked up once.

`Metric.labels(...)` takes a lock and hashes the label tuple on every call; a worker serves one
(model, version), so its children are fixed at start and each batch only observes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sluice.batcher import Batch
from sluice.jobs import CLOSE_REASONS, JobStatus
from sluice.metrics import BATCH_CLOSED, BATCH_SIZE, JOBS_FINISHED, MODEL_TIME, PADDING_RATIO, QUEUE_WAIT
from workers.execution import Outcome


class BatchMetrics:
    def __init__(self, *, model: str, version: str) -> None:
        self.finished = {
            status: JOBS_FINISHED.labels(model, version, status.value)
            for status in (JobStatus.succeeded, JobStatus.failed, JobStatus.expired)
        }
        self._closed = {reason: BATCH_CLOSED.labels(model, version, reason) for reason in CLOSE_REASONS}
        self._size = BATCH_SIZE.labels(model, version)
        self._model_time = MODEL_TIME.labels(model, version)
        self._padding = PADDING_RATIO.labels(model, version)
        self._queue_wait = QUEUE_WAIT.labels(model, version)

    def batch(
        self, batch: Batch[Any], outcomes: Sequence[Outcome], won: Sequence[bool], *, started: float, model_s: float
    ) -> None:
        """A stored batch; only the writes that made a job final count it, as with its sample."""
        size = len(batch.items)
        self._size.observe(size)
        self._closed[batch.close_reason].inc()
        self._model_time.observe(model_s)
        real = sum(max(1, item.cost) for item in batch.items)
        self._padding.observe(batch.max_cost * size / real if real else 1.0)
        for item in batch.items:
            self._queue_wait.observe(max(0.0, started - item.enqueued_at))
        failed = succeeded = 0
        for outcome, first in zip(outcomes, won, strict=True):
            if first:
                if outcome.error is None:
                    succeeded += 1
                else:
                    failed += 1
        if failed:
            self.finished[JobStatus.failed].inc(failed)
        if succeeded:
            self.finished[JobStatus.succeeded].inc(succeeded)
