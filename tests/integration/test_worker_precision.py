"""A real worker serving a ``?precision=auto`` MiniLM version runs what its start-up calibration
chose, reports it and the measured ratio in its heartbeat and on the version resource, and a margin
no host reaches keeps it in fp32."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import redis

from sluice.wire import keys
from sluice.wire.heartbeats import Heartbeat
from tests.support import WorkerProcess, unique

pytestmark = [pytest.mark.model, pytest.mark.slow]

# One measured round keeps the start-up short; the choice rule is the same at any count.
QUICK = {"SLUICE_PRECISION_CALIBRATION_ROUNDS": "1"}
TEXTS = ["where is my parcel", "please explain why my card payment was declined at the store today " * 6]


def heartbeat_of(rds: redis.Redis, worker: WorkerProcess) -> Heartbeat:
    for key in rds.scan_iter(match=keys.heartbeat_pattern(worker.model, worker.version), count=1000):
        beat = Heartbeat.from_fields(rds.hgetall(key))  # type: ignore[arg-type]
        if beat.pid == worker.proc.pid:
            return beat
    raise AssertionError(f"no heartbeat from {worker.version}:\n{worker.log()}")


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def test_auto_runs_the_precision_its_calibration_chose_and_reports_the_ratio(
    admin: httpx.Client,
    demo: httpx.Client,
    rds: redis.Redis,
    start_worker: Callable[..., WorkerProcess],
    wait_jobs: Callable[..., list[dict[str, Any]]],
) -> None:
    from sluice.artifacts import MINILM_URI, artifact_sha256, resolve_artifact
    from workers.models.calibration import host_precisions
    from workers.models.precision import candidates

    model = unique("auto")
    assert admin.post("/v1/models", json={"name": model, "kind": "embedding"}).status_code == 201
    sha = artifact_sha256(resolve_artifact(MINILM_URI))
    for version in ("auto", "never"):
        response = admin.post(
            f"/v1/models/{model}/versions",
            json={"version": version, "artifact": f"{MINILM_URI}?precision=auto", "sha256": sha, "state": "stable"},
        )
        assert response.status_code == 201, response.text
    assert admin.put(f"/v1/models/{model}/routing", json={"weights": {"auto": 50, "never": 50}}).status_code == 200

    auto = start_worker(model, "auto", env=QUICK)
    never = start_worker(model, "never", env={**QUICK, "SLUICE_PRECISION_MIN_SPEEDUP": "1000"})
    chosen, fp32 = heartbeat_of(rds, auto), heartbeat_of(rds, never)

    assert chosen.precision in candidates("auto", host_precisions("cpu"))
    # A precision other than fp32 runs only with its measured speed-up, and reports it.
    assert (chosen.precision_speedup is not None) is (chosen.precision != "fp32")
    if chosen.precision_speedup is not None:
        assert chosen.precision_speedup >= 1.15
    assert (fp32.precision, fp32.precision_speedup) == ("fp32", None)
    resource = admin.get(f"/v1/models/{model}/versions/auto").json()
    assert resource["running_precision"] == [
        {"precision": chosen.precision, "workers": 1,
         "speedup": None if chosen.precision_speedup is None else round(chosen.precision_speedup, 3)}]

    # The precision reported is the one that runs: int8 vectors differ from fp32's, a little.
    outputs = {}
    for version in ("auto", "never"):
        ids = [
            demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": t}, "version": version}).json()["id"]
            for t in TEXTS
        ]
        jobs = wait_jobs(demo, ids, timeout_s=120)
        assert [job["status"] for job in jobs] == ["succeeded"] * len(TEXTS), jobs
        outputs[version] = [job["output"]["embedding"] for job in jobs]
    for a, b in zip(outputs["auto"], outputs["never"], strict=True):
        similarity = cosine(a, b)
        assert similarity > 0.99
        assert similarity >= 0.999  # the quality bound
        if chosen.precision == "fp32":
            assert similarity > 0.99999
