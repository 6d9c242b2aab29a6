"""An int8 MiniLM shadowed against fp32 on real workers: promoted to canary only when its
agreement with fp32 clears the policy's bar; a bar above what it achieves keeps it in shadow."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from scheduler.guardrails import SHADOW_STEP, Position, decide
from scheduler.planning.text_mix import skewed_texts
from scheduler.rollout import RolloutController, evidence_from_samples
from sluice.registry import rollouts
from sluice.registry.store import Registry
from sluice.rollout_policy import Policy
from sluice.wire import connections
from sluice.wire.samples import read_samples
from tests.support import unique

JOBS = 160
BAR = 0.95


@pytest.mark.soak
@pytest.mark.model
@pytest.mark.slow
def test_int8_is_promoted_from_shadow_only_when_agreement_clears_the_bar(
    admin: httpx.Client, demo: httpx.Client, registry: Registry, redis_url: str,
    start_worker: Callable[..., Any], wait_jobs: Callable[..., list[dict[str, Any]]],
    figure: Callable[[str, object], None],
) -> None:
    from sluice.artifacts import MINILM_URI, artifact_sha256, resolve_artifact

    sha = artifact_sha256(resolve_artifact(MINILM_URI))
    model = unique("minilm")
    assert admin.post("/v1/models", json={"name": model, "kind": "embedding"}).status_code == 201
    for version, artifact, state in (("fp32", MINILM_URI, "stable"), ("int8", f"{MINILM_URI}?quantize=int8", "shadow")):
        response = admin.post(f"/v1/models/{model}/versions", json={
            "version": version, "artifact": artifact, "sha256": sha, "state": state,
            "batching": {"max_batch_size": 32, "max_wait_ms": 20}})
        assert response.status_code == 201, response.text
    # A shadow version's weight is the share of stable's jobs copied to it: all of them here.
    assert admin.put(f"/v1/models/{model}/routing", json={"weights": {"fp32": 100, "int8": 100}}).status_code == 200
    start_worker(model, "fp32")
    start_worker(model, "int8")

    texts = skewed_texts(JOBS, seed=5)
    ids = [demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": t}, "lane": "bulk"}).json()["id"]
           for t in texts]
    jobs = wait_jobs(demo, ids, timeout_s=240)
    assert {(j["status"], j["version"]) for j in jobs} == {("succeeded", "fp32")}, "shadow output is never returned"

    policy = {"steps": [5, 25, 100], "soak_s": 0, "min_samples": 100, "min_test_samples": 30,
              "look_interval_s": 0.5, "min_agreement": BAR}
    with registry.session() as session:
        started = rollouts.start_rollout(session, model=model, canary="int8", policy=policy, actor="test",
                                         now=datetime.fromtimestamp(time.time() - 600, UTC))
        assert started.step_index == SHADOW_STEP

    async def look() -> tuple[Any, Any]:
        client = connections.connect(redis_url)
        try:
            deadline = time.monotonic() + 60
            while True:
                samples = await read_samples(client, model, "int8", window_s=3600)
                if sum(1 for s in samples if "agreement" in s.quality) >= JOBS or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
            looks = await RolloutController(registry=registry, redis=client).tick()
            return looks, samples
        finally:
            await client.aclose()

    looks, samples = asyncio.run(look())
    agreements = sorted(float(s.quality["agreement"]) for s in samples if "agreement" in s.quality)
    assert len(agreements) == JOBS
    figure("shadow_copies_compared", len(agreements))
    figure("agreement_mean", round(sum(agreements) / len(agreements), 4))
    figure("agreement_min", round(agreements[0], 4))
    figure("bar", BAR)
    assert len(looks) == 1
    decision = looks[0].decision
    assert decision.action == "promote", decision.reason
    with registry.session() as session:
        promoted = rollouts.latest_rollout(session, model)
        assert promoted.step_index == 0
    assert admin.get(f"/v1/models/{model}").json()["routing"].get("int8") == 5.0

    # The same evidence against a bar above what int8 reaches: it stays out of the traffic.
    strict = Policy.from_dict({**policy, "min_agreement": 0.9999})
    evidence = evidence_from_samples(samples, live_workers=1)
    now = time.time()
    verdict = decide(now=now, canary=evidence, stable=evidence, policy=strict,
                     position=Position(step=SHADOW_STEP, step_started_at=now - 600, started_at=now - 600))
    assert verdict.action != "promote", verdict.reason
    figure("verdict_at_bar_0.9999", verdict.action)
