"""A confidently wrong classifier canary is rolled back by the controller, on real workers.

The canary's head is the shipped intent head with its output rows deranged: every answer moves
to another label with the original's confidence. Latency, errors and top probability stay the
same, so only the quality proxy can see it: the label distribution. Traffic is skewed across
intents as production traffic is (under perfectly uniform traffic a permutation leaves the label
distribution unchanged; shadowing the canary, whose agreement gate is tested in
tests/integration/test_rollout.py, is the tool for that case).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from scheduler.rollout import RolloutController
from sluice.registry import rollouts
from sluice.registry.store import Registry
from sluice.wire import connections, events
from tests.support import REPO, unique

INTENTS = REPO / "workers" / "models" / "data" / "intents.jsonl"


def _skewed_texts(count: int, seed: int) -> list[str]:
    by_label: dict[str, list[str]] = {}
    for line in INTENTS.read_text().splitlines():
        row = json.loads(line)
        by_label.setdefault(row["label"], []).append(row["text"])
    labels = sorted(by_label)
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) for rank in range(len(labels))]  # Zipf-like: a few intents dominate
    return [rng.choice(by_label[rng.choices(labels, weights)[0]]) for _ in range(count)]


@pytest.mark.soak
@pytest.mark.model
@pytest.mark.slow
def test_a_confidently_wrong_canary_at_5_percent_is_rolled_back(
    admin: httpx.Client,
    demo: httpx.Client,
    registry: Registry,
    redis_url: str,
    tmp_path: Path,
    start_worker: Callable[..., Any],
    figure: Callable[[str, object], None],
) -> None:
    from sluice.artifacts import artifact_sha256, resolve_artifact
    from workers.models.head import write_degraded_head

    shipped = "pkg:workers.models/intent_head.safetensors"
    degraded = tmp_path / "degraded_head.safetensors"
    write_degraded_head(resolve_artifact(shipped), degraded, seed=7)
    model = unique("intent")
    assert admin.post("/v1/models", json={"name": model, "kind": "classifier"}).status_code == 201
    for version, artifact, path, state in (
        ("v1", shipped, resolve_artifact(shipped), "stable"),
        ("v2", f"file://{degraded}", degraded, "canary"),
    ):
        response = admin.post(
            f"/v1/models/{model}/versions",
            json={
                "version": version,
                "artifact": artifact,
                "sha256": artifact_sha256(path),
                "state": state,
                "batching": {"max_batch_size": 32, "max_wait_ms": 20},
            },
        )
        assert response.status_code == 201, response.text
    assert admin.put(f"/v1/models/{model}/routing", json={"weights": {"v1": 100}}).status_code == 200
    start_worker(model, "v1")
    start_worker(model, "v2")

    policy = {"steps": [5, 25, 100], "soak_s": 3600, "min_samples": 200, "min_test_samples": 30, "look_interval_s": 1.0}
    with registry.session() as session:
        rollout_id = rollouts.start_rollout(
            session, model=model, canary="v2", policy=policy, actor="test", now=datetime.now(UTC)
        ).id

    async def drive() -> tuple[str, Any]:
        client = connections.connect(redis_url)
        try:
            await events.announce_routing(client, model)
            controller = RolloutController(registry=registry, redis=client)
            texts = _skewed_texts(6000, seed=11)
            sent, deadline = 0, time.monotonic() + 240
            async with httpx.AsyncClient(
                base_url=str(demo.base_url),
                headers=dict(demo.headers),
                timeout=30,
                limits=httpx.Limits(max_connections=16),
            ) as http:
                while time.monotonic() < deadline:
                    burst = texts[sent : sent + 150]
                    assert burst, "traffic ran out before the controller decided"
                    replies = await asyncio.gather(
                        *[
                            http.post(
                                f"/v1/models/{model}/jobs",
                                json={"input": {"text": text}, "routing_key": f"user-{sent + i}", "lane": "bulk"},
                            )
                            for i, text in enumerate(burst)
                        ]
                    )
                    assert {r.status_code for r in replies} == {202}
                    sent += len(burst)
                    for look in await controller.tick():
                        if look.decision.action != "continue":
                            return look.decision.action, look.decision
                    await asyncio.sleep(0.5)
            raise AssertionError("no decision within 240 s")
        finally:
            await client.aclose()

    action, decision = asyncio.run(drive())
    assert action == "rollback", decision.reason
    assert "label_shift" in decision.reason
    tests = {t["test"]: t for t in decision.evidence["tests"]}
    assert not tests["error_rate"]["breach"] and not tests["latency"]["breach"]
    canary_samples = decision.evidence["samples"]["canary"]
    # Always-valid tests pay for unlimited looks with some power; they must still act within a
    # few hundred canary samples (bench/rollout_aa.py: a median of 52, at most 107 of 200 seeds,
    # for 12 Zipf-weighted labels deranged in simulation).
    assert canary_samples <= 500, canary_samples
    figure("canary_weight_percent", decision.evidence["weight"])
    figure("canary_samples_at_rollback", canary_samples)
    figure("stable_samples_at_rollback", decision.evidence["samples"]["stable"])
    figure("label_tvd", tests["label_shift"]["effect"])

    with registry.session() as session:
        assert rollouts.latest_rollout(session, model).state == "rolled_back"
        assert rollouts.latest_rollout(session, model).id == rollout_id
    canary = admin.get(f"/v1/models/{model}/versions/v2/stats", params={"window_s": 600}).json()
    assert canary["count"] >= canary_samples and canary["errors"] == 0
    ready = demo.get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ok"
    deadline = time.monotonic() + 10
    while admin.get(f"/v1/models/{model}").json()["routing"].get("v2"):
        assert time.monotonic() < deadline, "the rollback did not take the canary's weight"
        time.sleep(0.1)
