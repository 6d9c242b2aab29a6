"""End to end over the real platform: the API in process, `sluice worker` subprocesses running
the real MiniLM models, Redis and Postgres.

Results are checked against the same model run in this process, not against constants. The
long-poll and SSE tests use a slow synthetic model so a job is surely running when they ask.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.support import sse_events

pytestmark = pytest.mark.slow

Jobs = list[dict[str, Any]]

_WORDS = (
    "the", "a", "my", "order", "card", "account", "money", "transfer", "please", "help", "where", "is",
    "when", "how", "why", "what", "can", "you", "I", "we", "they", "it", "to", "from", "with", "for",
    "on", "at", "in", "of", "and", "or", "but", "not", "yesterday", "today", "tomorrow", "bank",
    "branch", "payment", "refund", "package", "delivery", "address", "password", "reset", "balance",
    "checking", "savings", "agent", "human", "store", "online", "website", "app", "phone", "email",
    "week", "month", "year", "arrived", "broken", "late", "early", "open", "close", "support",
    "question", "problem", "issue", "update", "change", "cancel", "confirm", "receipt", "invoice",
    "price", "total", "fee", "international", "domestic", "travel", "abroad", "weekend", "holiday",
    "schedule", "manager", "team", "customer", "service"
)


def mixed_texts(n: int, *, seed: int = 20240601) -> list[str]:
    """80% short texts (8-24 words) and 20% long ones (100-200 words), shuffled, reproducible."""
    rng = random.Random(seed)
    lengths = [rng.randint(8, 24) for _ in range(n - n // 5)] + [rng.randint(100, 200) for _ in range(n // 5)]
    rng.shuffle(lengths)
    return [" ".join(rng.choice(_WORDS) for _ in range(k)).capitalize() + "." for k in lengths]


def assert_timings_and_batch(job: dict[str, Any], max_batch_size: int) -> None:
    timings, batch = job["timings"], job["batch"]
    for name in ("queue_wait_ms", "model_ms", "total_ms"):
        assert timings[name] is not None and timings[name] >= 0, timings
    assert timings["total_ms"] >= timings["queue_wait_ms"], timings
    assert timings["started_at"] <= timings["finished_at"], timings
    assert 1 <= batch["size"] <= max_batch_size, batch
    assert batch["close_reason"] in {"size", "age", "drain"}, batch


@pytest.fixture(scope="module")
def encoder() -> Any:
    from sluice.artifacts import MINILM_URI, resolve_artifact
    from workers.models.minilm import MiniLMEncoder

    return MiniLMEncoder(model_dir=resolve_artifact(MINILM_URI))


@pytest.mark.model
def test_embeddings_of_a_mixed_length_bulk_match_the_model_in_process(
    demo: httpx.Client, admin: httpx.Client, start_worker: Callable[..., Any],
    wait_jobs: Callable[..., Jobs], encoder: Any,
) -> None:
    import torch

    max_batch_size = next(v for v in admin.get("/v1/models/minilm").json()["versions"]
                          if v["version"] == "v1")["batching"]["max_batch_size"]
    texts = mixed_texts(200)
    start_worker("minilm", "v1", threads=1)
    response = demo.post("/v1/models/minilm/jobs:bulk", json={"inputs": [{"text": t} for t in texts]})
    assert response.status_code == 202, response.text
    assert response.json()["version"] == "v1"

    jobs = wait_jobs(demo, response.json()["ids"], timeout_s=240)
    assert [job["status"] for job in jobs] == ["succeeded"] * len(texts)
    for job in jobs:
        assert job["output"]["dim"] == 384
        assert len(job["output"]["embedding"]) == 384
        assert_timings_and_batch(job, max_batch_size)
    assert sum(job["batch"]["size"] > 1 for job in jobs) >= len(jobs) // 2, "the worker did not batch"

    got = torch.tensor([job["output"]["embedding"] for job in jobs])
    # Length-sorted chunks: the reference pays little padding (padding does not change vectors).
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    expected = torch.empty_like(got)
    for start in range(0, len(order), 32):
        chunk = order[start:start + 32]
        expected[chunk] = encoder.encode([texts[i] for i in chunk])
    cosines = torch.nn.functional.cosine_similarity(got, expected, dim=1)
    assert cosines.min().item() >= 0.9999, cosines.topk(3, largest=False)


@pytest.mark.model
def test_intent_labels_come_from_the_head_and_match_the_model_in_process(
    demo: httpx.Client, start_worker: Callable[..., Any], wait_jobs: Callable[..., Jobs],
) -> None:
    from sluice.artifacts import INTENT_HEAD_URI, artifact_sha256, resolve_artifact
    from workers.models.head import read_head
    from workers.models.loading import load_handler

    head_path = resolve_artifact(INTENT_HEAD_URI)
    labels = json.loads(read_head(head_path)[1]["labels"])
    texts = [
        "I lost my credit card, please block it",
        "Where is my package? It should have arrived yesterday",
        "I forgot my password and cannot log in",
        "Let me talk to a real person",
        "What time do you open on Saturday?",
        "hello there",
    ]
    start_worker("intent", "v1", threads=1)
    response = demo.post("/v1/models/intent/jobs:bulk", json={"inputs": [{"text": t} for t in texts]})
    assert response.status_code == 202, response.text
    jobs = wait_jobs(demo, response.json()["ids"], timeout_s=120)

    reference = load_handler(kind="classifier", artifact=INTENT_HEAD_URI, sha256=artifact_sha256(head_path),
                             device="cpu").run([{"text": t} for t in texts])
    for job, expected in zip(jobs, reference, strict=True):
        assert job["status"] == "succeeded", job
        output = job["output"]
        assert output["label"] in labels
        assert set(output["scores"]) == set(labels)
        assert sum(output["scores"].values()) == pytest.approx(1.0, abs=1e-4)
        assert output["label"] == max(output["scores"], key=output["scores"].get)
        assert output["label"] == expected["label"]
        for label in labels:
            assert output["scores"][label] == pytest.approx(expected["scores"][label], abs=1e-3)
    assert jobs[0]["output"]["label"] == "card_lost"  # and the head is not garbage


# --- waiting for a result: long-poll and server-sent events ----------------------------------------


@pytest.fixture
def slow_model(register_synthetic: Callable[..., str], start_worker: Callable[..., Any]) -> Iterator[str]:
    """A synthetic model whose every batch takes 1 s, with a worker ready for it."""
    name = register_synthetic("slow", cost="fixed_s=1.0&per_item_s=0&per_token_s=0")
    start_worker(name)
    yield name


def test_long_poll_is_woken_by_the_completion(demo: httpx.Client, slow_model: str) -> None:
    job = demo.post(f"/v1/models/{slow_model}/jobs", json={"input": {"text": "wake me"}}).json()
    started = time.monotonic()
    response = demo.get(f"/v1/jobs/{job['id']}", params={"wait": 5})
    elapsed = time.monotonic() - started
    received_at = time.time()
    assert response.status_code == 200
    done = response.json()
    assert done["status"] == "succeeded"
    # It waited for a job that was not done (the model takes 1 s) and came back as soon as the
    # completion event arrived, long before the 5 s limit.
    assert 0.5 <= elapsed <= 3.0, elapsed
    finished_at = _epoch(done["timings"]["finished_at"])
    assert received_at - finished_at < 0.5, received_at - finished_at


def test_long_poll_gives_up_at_its_limit_with_the_current_state(
    demo: httpx.Client, register_synthetic: Callable[..., str]
) -> None:
    name = register_synthetic("idle")  # no worker: the job stays queued
    job = demo.post(f"/v1/models/{name}/jobs", json={"input": {"text": "nobody home"}}).json()
    started = time.monotonic()
    response = demo.get(f"/v1/jobs/{job['id']}", params={"wait": 0.6})
    elapsed = time.monotonic() - started
    assert response.status_code == 200 and response.json()["status"] == "queued"
    assert 0.55 <= elapsed < 2.0, elapsed


def test_events_stream_ends_with_the_final_state(demo: httpx.Client, slow_model: str) -> None:
    job = demo.post(f"/v1/models/{slow_model}/jobs", json={"input": {"text": "stream me"}}).json()
    events: list[tuple[str, str, dict[str, Any]]] = []
    with demo.stream("GET", f"/v1/jobs/{job['id']}/events", timeout=20) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events.extend(sse_events(response))
    names = [name for _, name, _ in events]
    assert names[-1] == "succeeded", names
    assert len(names) >= 2, names  # a running job's stream shows a change before the end
    order = ["queued", "running", "succeeded"]
    assert names == sorted(names, key=order.index) and len(set(names)) == len(names), names
    assert [int(i) for i, _, _ in events] == list(range(1, len(events) + 1))
    for _, name, data in events:
        assert data["id"] == job["id"] and data["status"] == name
    assert events[-1][2]["output"] == {"echo": {"text": "stream me"}}


def _epoch(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso).timestamp()
