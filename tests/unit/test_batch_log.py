"""The worker's batch log: a line per batch whose jobs someone follows by a request id they chose,
DEBUG lines for the rest, and a summary a minute (never inputs or outputs)."""

from __future__ import annotations

import logging

import pytest

from sluice.logs import is_generated_request_id, new_request_id
from workers.batch_log import BatchLog


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def store(batch_log: BatchLog, request_ids: list[str | None], reason: str = "age") -> None:
    batch_log.stored(lane="online", close_reason=reason, model_ms=3.0,
                     job_ids=[f"job_{i}" for i in range(len(request_ids))], request_ids=request_ids)


def test_only_ids_the_api_made_count_as_generated() -> None:
    assert is_generated_request_id(new_request_id())
    for chosen in ("order-42-try-1", "req_mine", "bat_0123456789abcdef", "req_" + "x" * 30):
        assert not is_generated_request_id(chosen)


def test_a_batch_with_a_chosen_request_id_is_logged_at_info_and_others_at_debug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    batch_log = BatchLog(model="m", version="v1", clock=Clock())
    with caplog.at_level(logging.DEBUG, logger="workers.worker"):
        store(batch_log, [new_request_id(), None])
        store(batch_log, [new_request_id(), "order-42-try-1"])
    quiet, followed = caplog.records
    assert quiet.levelno == logging.DEBUG and followed.levelno == logging.INFO
    assert followed.__dict__["job_ids"] == ["job_0", "job_1"]
    assert "order-42-try-1" in followed.__dict__["request_ids"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="workers.worker"):
        for _ in range(100):
            store(batch_log, [new_request_id()])
    assert caplog.records == []  # single-job traffic: no line per batch at INFO


def test_a_summary_at_most_once_per_period_counts_batches_jobs_and_close_reasons(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    batch_log = BatchLog(model="m", version="v1", summary_every_s=60.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="workers.worker"):
        for i in range(10):
            clock.now = i * 6.0
            store(batch_log, [new_request_id()] * 2, reason="size" if i % 2 else "age")
        assert caplog.records == []
        clock.now = 60.0
        store(batch_log, [new_request_id()])
    (summary,) = caplog.records
    assert summary.__dict__["batches"] == 11 and summary.__dict__["jobs"] == 21
    assert summary.__dict__["close_reasons"] == {"age": 6, "size": 5}
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="workers.worker"):
        clock.now = 61.0
        store(batch_log, [new_request_id()])
    assert caplog.records == []  # the next summary waits its period
