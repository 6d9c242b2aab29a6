"""The API's response models pass the kernel's bodies through unchanged (api/response_models.py).

A route validates `JobRecord.resource()` or `stats.summarise()` through its response model and
answers what the model dumps with `exclude_unset`. These tests hold that dump equal to the dict,
key for key, in order and type for type (an int must not come back a float), so a key the kernel
adds or drops, or a null that turns into an absence, fails here and not in a client.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from api.response_models import JobResource, ModelResource, StatsResource
from sluice.cost import Prices
from sluice.stats import summarise
from sluice.wire.jobs import JobRecord, JobStatus
from sluice.wire.samples import Sample


def assert_identical(got: Any, want: Any, where: str = "$") -> None:
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, dict):
        assert list(got) == list(want), f"{where}: keys {list(got)} != {list(want)}"
        for key in want:
            assert_identical(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_identical(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def round_trip(model: type[BaseModel], body: dict[str, Any]) -> dict[str, Any]:
    """What FastAPI answers for `body` under `response_model=model, response_model_exclude_unset=True`."""
    dumped: dict[str, Any] = model.model_validate(body).model_dump(mode="json", exclude_unset=True)
    return dumped


def _job(**changes: Any) -> JobRecord:
    base: dict[str, Any] = dict(id="job_x", tenant="t", model="m", version="v1", lane="online",
                                status=JobStatus.queued, input={"text": "hi"}, enqueued_at=1_700_000_000.25)
    return JobRecord(**{**base, **changes})


JOBS = {
    "queued": _job(),
    "running": _job(status=JobStatus.running, attempts=1, lane="bulk"),
    "succeeded": _job(status=JobStatus.succeeded, attempts=1, started_at=1_700_000_000.5,
                      finished_at=1_700_000_001.0, model_ms=12.5, batch_size=3, close_reason="age",
                      output={"embedding": [0.5, 1.0], "dim": 2}, cache_hit=True,
                      metadata={"a": 1, "b": "x", "c": True, "d": 1.5, "e": None}),
    "failed": _job(status=JobStatus.failed, attempts=2, started_at=1_700_000_000.5, finished_at=1_700_000_001.0,
                   model_ms=3.0, batch_size=1, close_reason="size",
                   error={"code": "inference_error", "message": "boom"}),
    "cancelled": _job(status=JobStatus.cancelled, finished_at=1_700_000_000.75),
    "retried": _job(status=JobStatus.failed, attempts=2, started_at=1_700_000_000.5, finished_at=1_700_000_001.0,
                    error={"code": "run_timeout", "message": "late again"}, deadline=1_700_000_060.5,
                    run_timeout_s=0.5, retry="2:run_timeout,worker_error",
                    attempt_errors=[{"error": {"code": "run_timeout", "message": "late"}, "at": 1_700_000_000.75}]),
}


@pytest.mark.parametrize("name", list(JOBS))
def test_a_job_resource_passes_through_unchanged(name: str) -> None:
    body = JOBS[name].resource()
    assert_identical(round_trip(JobResource, body), body)


def test_a_queued_job_keeps_its_nulls_and_has_no_output() -> None:
    body = round_trip(JobResource, JOBS["queued"].resource())
    assert body["timings"]["started_at"] is None and body["batch"] == {"size": None, "close_reason": None}
    assert "output" not in body and "error" not in body and "metadata" not in body


@pytest.mark.parametrize("samples", [
    [],
    [Sample(status="succeeded", finished_at=100.0, queue_wait_ms=1.0, model_ms=2.0, total_ms=3.0, batch_size=1,
            close_reason="age", quality={"size": 4})],
    [Sample(status="succeeded" if i % 3 else "failed", finished_at=100.0 + i, queue_wait_ms=float(i),
            model_ms=2.0, total_ms=3.0 + i, batch_size=1 + i % 2, close_reason=("size", "age", "drain")[i % 3],
            quality={"top_p": 0.3 + i / 20, "label": f"l{i % 2}", "agreement": 1}, fill_ms=1.5 + i,
            padded_tokens=40.0, real_tokens=12.5, core_s=0.25, idle_s=0.125)
     for i in range(10)],
], ids=["empty", "one", "with-quality"])
def test_a_stats_resource_passes_through_unchanged(samples: list[Sample]) -> None:
    body = {"model": "m", "version": "v1", **summarise(samples, window_s=300.0, prices=Prices(per_core_hour=0.05)),
            "resident_bytes": 90_000_000 if samples else None}
    assert_identical(round_trip(StatsResource, body), body)


def test_a_model_resource_passes_through_unchanged() -> None:
    version = {"version": "v1", "state": "stable", "artifact": "synthetic:?", "sha256": "0" * 64,
               "batching": {"max_batch_size": 32, "max_wait_ms": 10.0, "isolate_tenants": True},
               "min_replicas": 1, "max_replicas": 4, "cache_ttl_s": 0, "last_error": None,
               "replicas": {"desired": 2, "live": 1, "reason": "backlog 40"}}
    body = {"name": "m", "kind": "synthetic", "tier": "latency", "versions": [version], "routing": {"v1": 100.0}}
    assert_identical(round_trip(ModelResource, body), body)
