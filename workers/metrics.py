"""A worker's Prometheus series: the labelled children of `sluice.metrics`, looked up once.

`Metric.labels(...)` takes a lock and hashes the label tuple on every call; a worker serves one
(model, version), so its children are fixed at start (one set per lane) and each batch only
observes.
"""

from __future__ import annotations

from collections.abc import Sequence

from sluice.batcher import Batch
from sluice.cost import PassUsage
from sluice.metrics import (
    BATCH_CLOSED,
    BATCH_FILL,
    BATCH_SIZE,
    BATCH_WINDOW,
    CORE_SECONDS,
    GPU_SECONDS,
    INPUT_COST,
    JOB_SECONDS,
    JOBS_FINISHED,
    JOBS_OVER_BUDGET,
    MODEL_TIME,
    PADDED_TOKENS,
    PADDING_RATIO,
    QUEUE_WAIT,
    REAL_TOKENS,
    SLOT_IDLE,
)
from sluice.vocabulary import CLOSE_REASONS, LANES, Lane
from sluice.wire.jobs import JobStatus
from workers.execution import Outcome
from workers.results import Delivery


class _LaneSeries:
    def __init__(self, model: str, version: str, lane: Lane) -> None:
        self.closed = {reason: BATCH_CLOSED.labels(model, version, lane, reason) for reason in CLOSE_REASONS}
        self.size = BATCH_SIZE.labels(model, version, lane)
        self.fill = BATCH_FILL.labels(model, version, lane)
        self.window = BATCH_WINDOW.labels(model, version, lane)
        self.model_time = MODEL_TIME.labels(model, version, lane)
        self.padding = PADDING_RATIO.labels(model, version, lane)
        self.queue_wait = QUEUE_WAIT.labels(model, version, lane)
        self.job_seconds = JOB_SECONDS.labels(model, version, lane)
        self.over_budget = JOBS_OVER_BUDGET.labels(model, version, lane)
        self.padded_tokens = PADDED_TOKENS.labels(model, version, lane)
        self.real_tokens = REAL_TOKENS.labels(model, version, lane)
        self.input_cost = INPUT_COST.labels(model, version, lane)


class BatchMetrics:
    """`latency_budget_s`: the version's latency budget, against which each stored job counts as
    over or not; `max_wait_s`: the window a lane waits before its first arrivals."""

    def __init__(self, *, model: str, version: str, latency_budget_s: float = 2.0, max_wait_s: float = 0.0) -> None:
        self.latency_budget_s = latency_budget_s
        self.finished = {
            status: JOBS_FINISHED.labels(model, version, status.value)
            for status in (JobStatus.succeeded, JobStatus.failed, JobStatus.expired)
        }
        self._lanes = {lane: _LaneSeries(model, version, lane) for lane in LANES}
        for series in self._lanes.values():
            series.window.set(max_wait_s)
        self._idle = SLOT_IDLE.labels(model, version)
        self._core_s = CORE_SECONDS.labels(model, version)
        self._gpu_s = GPU_SECONDS.labels(model, version)

    def batch(
        self, batch: Batch[Delivery], outcomes: Sequence[Outcome], won: Sequence[bool], *, started: float,
        model_s: float, finished: float, window_s: float, usage: PassUsage | None = None,
    ) -> None:
        """A stored batch (one forward pass). Per-job series count only the writes that made a job
        final, as its sample does, so they agree with the stats resource. Without `usage` (jobs
        failed by their own timeout while their pass ran on) the pass is counted once, with the
        jobs it stored last."""
        series = self._lanes[batch.items[0].payload.lane]
        size = len(batch.items)
        series.size.observe(size)
        series.closed[batch.close_reason].inc()
        series.model_time.observe(model_s)
        series.fill.observe(max(0.0, batch.closed_at - min(item.payload.arrived_at for item in batch.items)))
        series.window.set(window_s)
        if usage is not None:
            series.padding.observe(usage.padded_tokens / usage.real_tokens if usage.real_tokens else 1.0)
            series.padded_tokens.inc(usage.padded_tokens)
            series.real_tokens.inc(usage.real_tokens)
            self._idle.inc(usage.idle_s)
            self._core_s.inc(usage.core_s)
            self._gpu_s.inc(usage.gpu_s)
        failed = succeeded = 0
        for item, outcome, first in zip(batch.items, outcomes, won, strict=True):
            if not first:
                continue
            series.queue_wait.observe(max(0.0, started - item.enqueued_at))
            series.job_seconds.observe(max(0.0, finished - item.enqueued_at))
            if finished - item.enqueued_at > self.latency_budget_s:
                series.over_budget.inc()
            series.input_cost.observe(item.cost)
            if outcome.error is None:
                succeeded += 1
            else:
                failed += 1
        if failed:
            self.finished[JobStatus.failed].inc(failed)
        if succeeded:
            self.finished[JobStatus.succeeded].inc(succeeded)
