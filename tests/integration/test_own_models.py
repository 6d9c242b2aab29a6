"""A team's own models through the public surface: a handler class written in a test package and two
Hugging Face models built on the spot are published, registered over REST, served by real worker
processes with batching, canaried and rolled back like MiniLM; a tampered artifact refuses its
version; a handler that misbehaves fails the jobs it misbehaves on, and a hung one its batch."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from sluice.artifact_store import publish
from sluice.handler import schemas_of
from tests.exported_models import build_exported_program, linear_softmax
from tests.hf_models import build_tiny_classifier, build_tiny_encoder
from tests.own_models.scorer import TinyScorer, build_scorer
from tests.support import WorkerProcess, unique, wait_job, wait_until

pytestmark = pytest.mark.slow

SCORER = "tests.own_models.scorer:TinyScorer"
Jobs = list[dict[str, Any]]


def _create(admin: httpx.Client, kind: str) -> str:
    name = unique(kind.replace("-", ""))
    created = admin.post("/v1/models", json={"name": name, "kind": kind})
    assert created.status_code == 201, created.text
    return name


def _register(admin: httpx.Client, model: str, version: str, artifact: Path, store: str, *,
              state: str = "stable", **fields: Any) -> dict[str, Any]:
    published = publish(artifact, store)
    response = admin.post(f"/v1/models/{model}/versions", json={
        "version": version, "artifact": published.uri, "sha256": published.sha256, "state": state,
        "batching": {"max_batch_size": 16, "max_wait_ms": 50}, **fields})
    assert response.status_code == 201, response.text
    return dict(response.json())


def _route(admin: httpx.Client, model: str, weights: dict[str, float]) -> None:
    response = admin.put(f"/v1/models/{model}/routing", json={"weights": weights, "reason": "test"})
    assert response.status_code == 200, response.text


def _submit(client: httpx.Client, model: str, payload: dict[str, Any], *, routing_key: str | None = None) -> str:
    response = client.post(f"/v1/models/{model}/jobs", json={"input": payload, "routing_key": routing_key})
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def _bulk(client: httpx.Client, model: str, inputs: list[dict[str, Any]]) -> list[str]:
    response = client.post(f"/v1/models/{model}/jobs:bulk", json={"inputs": inputs})
    assert response.status_code == 202, response.text
    return [str(job_id) for job_id in response.json()["ids"]]


def _canary_then_roll_back(admin: httpx.Client, demo: httpx.Client, model: str,
                           make_input: Callable[[int], dict[str, Any]]) -> None:
    """v2 (staged) becomes a 50 % canary through the rollout API, serves beside v1, and a rollback
    gives all traffic back to v1."""
    started = admin.post(f"/v1/models/{model}/rollouts", json={"canary": "v2", "steps": [50, 100],
                                                               "soak_s": 3600, "min_samples": 1000})
    assert started.status_code == 201, started.text
    assert admin.get(f"/v1/models/{model}").json()["routing"] == {"v1": 50.0, "v2": 50.0}
    # Routing is sticky per routing key (the tenant by default): one key per end user.
    canaried = [wait_job(demo, _submit(demo, model, make_input(i), routing_key=f"user-{i}")) for i in range(24)]
    assert {job["status"] for job in canaried} == {"succeeded"}, canaried
    assert {job["version"] for job in canaried} == {"v1", "v2"}
    aborted = admin.delete(f"/v1/models/{model}/rollouts/current", params={"reason": "test rollback"})
    assert aborted.status_code == 200, aborted.text
    assert admin.get(f"/v1/models/{model}").json()["routing"] == {"v1": 100.0}
    after = [wait_job(demo, _submit(demo, model, make_input(i), routing_key=f"user-{i}")) for i in range(6)]
    assert {job["version"] for job in after} == {"v1"}


@pytest.fixture
def store(tmp_path: Path) -> str:
    return (tmp_path / "store").as_uri()


def test_a_handler_class_is_registered_served_in_batches_canaried_and_rolled_back(
    admin: httpx.Client, demo: httpx.Client, start_worker: Callable[..., WorkerProcess],
    wait_jobs: Callable[..., Jobs], tmp_path: Path, store: str,
) -> None:
    model = _create(admin, "handler")
    schemas = schemas_of(TinyScorer)
    fields = {"handler": SCORER, "input_schema": schemas["input"], "output_schema": schemas["output"]}
    registered = _register(admin, model, "v1", build_scorer(tmp_path / "v1", scale=1.0), store, **fields)
    assert registered["handler"] == SCORER and registered["input_schema"] == schemas["input"]
    _register(admin, model, "v2", build_scorer(tmp_path / "v2", scale=-1.0), store, state="staged", **fields)
    _route(admin, model, {"v1": 100})

    # Checked against the recorded schema before anything is queued, without echoing the input.
    refused = demo.post(f"/v1/models/{model}/jobs", json={"input": {"values": ["secret"]}})
    assert refused.status_code == 422, refused.text
    assert refused.json()["error"]["message"].startswith("input.values[0]: does not satisfy")
    assert "secret" not in refused.text

    start_worker(model, "v1")
    start_worker(model, "v2")
    ids = _bulk(demo, model, [{"values": [float(i % 5) - 2, 1.0]} for i in range(40)])
    jobs = wait_jobs(demo, ids)
    assert {job["status"] for job in jobs} == {"succeeded"}
    assert max(job["batch"]["size"] for job in jobs) > 1, "the handler's jobs were never batched"
    assert jobs[4]["output"]["label"] == "high" and jobs[0]["output"]["label"] == "low"
    stats = admin.get(f"/v1/models/{model}/versions/v1/stats").json()
    assert stats["quality"]["label_counts"]["high"] >= 1 and "mean_top_p" in stats["quality"], stats

    _canary_then_roll_back(admin, demo, model, lambda i: {"values": [float(i)]})


def test_a_handler_that_raises_miscounts_or_misshapes_fails_only_those_jobs_with_a_clear_error(
    admin: httpx.Client, demo: httpx.Client, start_worker: Callable[..., WorkerProcess],
    wait_jobs: Callable[..., Jobs], tmp_path: Path, store: str,
) -> None:
    model = _create(admin, "handler")
    _register(admin, model, "v1", build_scorer(tmp_path / "scorer"), store, handler=SCORER)
    _route(admin, model, {"v1": 100})
    start_worker(model)
    behaviours = ["well", "raise", "well", "miscount", "well", "misshape", "well"]
    jobs = wait_jobs(demo, _bulk(demo, model, [{"values": [1.0], "behave": b} for b in behaviours]))
    assert [job["status"] for job in jobs] == ["succeeded", "failed"] * 3 + ["succeeded"]
    messages = [job["error"]["message"] for job in jobs if job["status"] == "failed"]
    assert "raised ValueError" in messages[0]
    assert "answered 2 outputs for 1 inputs" in messages[1]
    assert "does not fit Score" in messages[2]


@pytest.mark.soak  # waits out a per-batch timeout and a fresh worker's start: about 8 s
def test_a_handler_that_hangs_fails_its_batch_and_its_worker_gives_way_to_a_fresh_one(
    admin: httpx.Client, demo: httpx.Client, start_worker: Callable[..., WorkerProcess], tmp_path: Path,
    store: str,
) -> None:
    model = _create(admin, "handler")
    _register(admin, model, "v1", build_scorer(tmp_path / "scorer"), store, handler=SCORER)
    _route(admin, model, {"v1": 100})
    hung = start_worker(model, env={"SLUICE_BATCH_TIMEOUT_S": "2"})
    job = wait_job(demo, _submit(demo, model, {"values": [1.0], "behave": "hang"}), timeout_s=30)
    assert job["status"] == "failed", job
    assert job["error"]["code"] == "handler_timeout", job
    wait_until(lambda: hung.proc.poll() is not None, timeout_s=20, what="the hung worker's exit")
    assert hung.proc.returncode != 0
    start_worker(model, env={"SLUICE_BATCH_TIMEOUT_S": "2"})
    assert wait_job(demo, _submit(demo, model, {"values": [1.0]}))["status"] == "succeeded"


@pytest.mark.soak
def test_two_hugging_face_models_are_served_canaried_and_rolled_back(
    admin: httpx.Client, demo: httpx.Client, start_worker: Callable[..., WorkerProcess],
    wait_jobs: Callable[..., Jobs], tmp_path: Path, store: str,
) -> None:
    encoder = _create(admin, "hf-embedding")
    _register(admin, encoder, "v1", build_tiny_encoder(tmp_path / "enc1", seed=0), store)
    _register(admin, encoder, "v2", build_tiny_encoder(tmp_path / "enc2", seed=1), store, state="staged")
    _route(admin, encoder, {"v1": 100})
    classifier = _create(admin, "hf-classifier")
    _register(admin, classifier, "v1", build_tiny_classifier(tmp_path / "cls1", seed=0), store)
    _register(admin, classifier, "v2", build_tiny_classifier(tmp_path / "cls2", seed=1), store, state="staged")
    _route(admin, classifier, {"v1": 100})
    for model in (encoder, classifier):
        start_worker(model, "v1")
        start_worker(model, "v2")

    texts = [{"text": f"order {i} " + "never arrived " * (i % 7)} for i in range(30)]
    embedded = wait_jobs(demo, _bulk(demo, encoder, texts))
    assert {job["status"] for job in embedded} == {"succeeded"}
    assert max(job["batch"]["size"] for job in embedded) > 1
    dim = embedded[0]["output"]["dim"]
    assert all(len(job["output"]["embedding"]) == dim for job in embedded)
    classified = wait_jobs(demo, _bulk(demo, classifier, texts))
    assert {job["output"]["label"] for job in classified} <= {"neg", "pos", "neutral"}
    assert all(abs(sum(job["output"]["scores"].values()) - 1) < 1e-4 for job in classified)
    assert demo.post(f"/v1/models/{encoder}/jobs", json={"input": {"txt": "hi"}}).status_code == 422

    _canary_then_roll_back(admin, demo, encoder, lambda i: {"text": f"where is parcel {i}"})
    _canary_then_roll_back(admin, demo, classifier, lambda i: {"text": f"refund for order {i}"})


@pytest.mark.parametrize("tampered", ["config.json", "tokenizer.json", "model.safetensors"])
def test_a_changed_file_of_a_published_directory_refuses_its_version(
    admin: httpx.Client, start_worker: Callable[..., WorkerProcess], tmp_path: Path, store: str, tampered: str,
) -> None:
    model = _create(admin, "hf-embedding")
    registered = _register(admin, model, "v1", build_tiny_encoder(tmp_path / "enc"), store)
    published = Path(registered["artifact"].removeprefix("file://")) / tampered
    published.write_bytes(published.read_bytes() + b" ")
    with pytest.raises(AssertionError, match="worker exited with 3"):
        start_worker(model)
    version = admin.get(f"/v1/models/{model}/versions/v1").json()
    assert "mismatch" in (version["last_error"] or ""), version


def test_an_exported_program_is_served_in_batches_with_its_declared_schemas(
    admin: httpx.Client, demo: httpx.Client, start_worker: Callable[..., WorkerProcess],
    wait_jobs: Callable[..., Jobs], tmp_path: Path, store: str,
) -> None:
    import torch

    model = _create(admin, "torch-export")
    program, input_schema, output_schema = build_exported_program(tmp_path / "program", seed=3)
    _register(admin, model, "v1", program, store, input_schema=input_schema, output_schema=output_schema)
    _route(admin, model, {"v1": 100})
    refused = demo.post(f"/v1/models/{model}/jobs", json={"input": {"features": [1.0, 2.0]}})
    assert refused.status_code == 422 and "minItems" in refused.text, refused.text
    start_worker(model)
    rows = [[float(i), -1.0, 0.5 * i, 2.0] for i in range(20)]
    jobs = wait_jobs(demo, _bulk(demo, model, [{"features": row} for row in rows]))
    assert {job["status"] for job in jobs} == {"succeeded"}
    assert max(job["batch"]["size"] for job in jobs) > 1
    with torch.inference_mode():
        expected = linear_softmax(3)(torch.tensor(rows)).tolist()
    for job, want in zip(jobs, expected, strict=True):
        assert job["output"]["probabilities"] == pytest.approx(want, abs=1e-6)
