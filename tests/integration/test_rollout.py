"""The rollout controller against real Redis and Postgres, one look at a time on an injected clock.

No model runs: samples are appended to the versions' stats streams in the workers' field layout
(workers/worker.py `_store`), with stream ids at the simulated time, and live workers are
entries in the `live` sorted set, as heartbeats leave them.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import httpx
import numpy as np
import pytest
import redis
import redis.asyncio as aioredis
from sqlalchemy import select

from scheduler.rollout import Look, RolloutController
from sluice.errors import BadRequest, Conflict
from sluice.registry import catalog, rollouts, routing_table
from sluice.registry.store import Registry
from sluice.registry.tables import AuditEntry, Rollout, RolloutDecision
from sluice.rollout_policy import Policy
from sluice.wire import keys
from sluice.wire.connections import connect
from sluice.wire.events import channel as events_channel

POLICY = Policy(steps=(10, 50, 100), soak_s=60, min_samples=60, min_test_samples=50, look_interval_s=10)
LABELS = {"billing": 0.4, "tech": 0.3, "account": 0.2, "other": 0.1}
SHA = "0" * 64  # synthetic artifacts have no file, so the hash is never checked


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def aredis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = connect(redis_url, max_connections=4)
    yield client
    await client.aclose()


def make_model(
    registry: Registry,
    *,
    kind: str = "synthetic",
    weights: dict[str, float] | None = None,
    states: dict[str, str] | None = None,
) -> str:
    name = f"roll-{secrets.token_hex(3)}"
    states = states or {"v1": "stable", "v2": "staged"}
    with registry.session() as session:
        catalog.create_model(session, name=name, kind=kind, actor="test")
        for version, state in states.items():
            catalog.register_version(
                session,
                model=name,
                version=version,
                artifact="synthetic:?fixed_s=0.001",
                sha256=SHA,
                actor="test",
                state=state,
            )
        routing_table.set_routing(session, model=name, weights=weights or {"v1": 100.0}, actor="test", reason="setup")
    return name


def add_samples(
    rds: redis.Redis,
    model: str,
    version: str,
    *,
    at: float,
    n: int,
    seed: int,
    errors: int = 0,
    latency_ms: float = 40.0,
    labels: dict[str, float] | None = None,
    agreement: float | None = None,
) -> None:
    """`n` finished jobs at simulated time `at`, as a worker's `_store` writes them."""
    rng = np.random.default_rng(seed)
    pipe = rds.pipeline(transaction=False)
    names = list(labels or {})
    for i in range(n):
        failed = i < errors
        total = float(rng.lognormal(np.log(latency_ms), 0.3))
        sample = {
            "s": "failed" if failed else "succeeded",
            "t": repr(at),
            "qw": "1.0",
            "m": repr(total / 2),
            "tt": repr(round(total, 3)),
            "b": "8",
            "r": "size",
        }
        quality: dict[str, Any] = {"size": 40}
        if labels and not failed:
            quality["label"] = str(rng.choice(names, p=list(labels.values())))
            quality["top_p"] = round(float(rng.beta(17, 3)), 6)
        if agreement is not None and not failed:
            quality["agreement"] = 1.0 if rng.random() < agreement else 0.0
        sample["q"] = json.dumps(quality, separators=(",", ":"))
        pipe.xadd(keys.stats(model, version), sample, id=f"{int(at * 1000)}-*")  # type: ignore[arg-type]
    pipe.execute()


def beat(rds: redis.Redis, model: str, *versions: str, at: float) -> None:
    for version in versions:
        rds.zadd(keys.live_workers(model, version), {f"w-{version}": at})


def weights(registry: Registry, model: str) -> dict[str, float]:
    with registry.session() as session:
        return catalog.routing_weights(session, model)


def decision_rows(registry: Registry, rollout_id: int) -> list[RolloutDecision]:
    with registry.session() as session:
        return list(
            session.scalars(
                select(RolloutDecision).where(RolloutDecision.rollout_id == rollout_id).order_by(RolloutDecision.id)
            )
        )


def routing_audit(registry: Registry, model: str) -> list[AuditEntry]:
    with registry.session() as session:
        return list(
            session.scalars(
                select(AuditEntry)
                .where(AuditEntry.model == model, AuditEntry.action == "routing.set")
                .order_by(AuditEntry.id)
            )
        )


async def looks_at(controller: RolloutController, model: str) -> list[Look]:
    """One tick's looks at this test's model (rollouts another test left running are looked at too)."""
    return [look for look in await controller.tick() if look.model == model]


def start(registry: Registry, model: str, clock: Clock, policy: Policy = POLICY, canary: str = "v2") -> int:
    with registry.session() as session:
        return rollouts.start_rollout(
            session,
            model=model,
            canary=canary,
            policy=policy.to_dict(),
            actor="test",
            now=datetime.fromtimestamp(clock.now, UTC),
        ).id


async def test_a_healthy_canary_is_promoted_along_the_steps(
    registry: Registry, rds: redis.Redis, aredis: aioredis.Redis
) -> None:
    model = make_model(registry)
    clock = Clock()
    rollout_id = start(registry, model, clock)
    assert weights(registry, model) == {"v1": 90.0, "v2": 10.0}
    controller = RolloutController(registry=registry, redis=aredis, clock=clock)
    events = rds.pubsub(ignore_subscribe_messages=True)
    events.subscribe(events_channel(rds))

    clock.now += 5
    beat(rds, model, "v1", "v2", at=clock.now)
    [first] = await looks_at(controller, model)
    assert (first.decision.action, first.decision.reason) == (
        "continue",
        "soaking 5/60 s; canary samples 0/60; stable samples 0/60",
    )
    assert await looks_at(controller, model) == [], "a second tick within the look interval must not look"

    for seed, expected in ((1, {"v1": 50.0, "v2": 50.0}), (2, {"v2": 100.0})):
        clock.now += 1
        add_samples(rds, model, "v1", at=clock.now, n=150, seed=seed, errors=1)
        add_samples(rds, model, "v2", at=clock.now, n=80, seed=seed + 100, errors=1)
        clock.now += 60
        beat(rds, model, "v1", "v2", at=clock.now)
        [look] = await looks_at(controller, model)
        assert look.decision.action == "promote", look.decision.reason
        assert look.applied is not None and look.applied.routing_changed
        assert weights(registry, model) == expected
        assert {t["test"] for t in look.decision.evidence["tests"]} == {"error_rate", "latency"}

    with registry.session() as session:
        row = session.get(Rollout, rollout_id)
        assert row is not None and (row.state, row.step_index) == ("promoted", 2)
        assert row.finished_at is not None
        assert catalog.get_version(session, model, "v2").state == "stable"
    assert await looks_at(controller, model) == [], "a finished rollout is not looked at"

    rows = decision_rows(registry, rollout_id)
    assert [r.action for r in rows] == ["start", "continue", "promote", "promote"]
    assert [r.step_index for r in rows] == [0, 0, 0, 1]
    assert rows[1].evidence["samples"] == {"canary": 0, "stable": 0, "required": 60}
    audit = routing_audit(registry, model)
    # setup, start at 10 %, 50 %, 100 %: each change one audited row, linked from its decision.
    assert [a.after for a in audit[1:]] == [{"v1": 90.0, "v2": 10.0}, {"v1": 50.0, "v2": 50.0}, {"v2": 100.0}]
    assert [r.audit_id for r in rows] == [audit[1].id, None, audit[2].id, audit[3].id]
    assert {a.actor for a in audit[2:]} == {"rollout-controller"}

    # Pub/sub ignores the DB index: other sessions' events arrive too.
    announced = []
    deadline = time.monotonic() + 5
    while len(announced) < 2 and time.monotonic() < deadline:
        message = events.get_message(timeout=0.2)
        if message and json.loads(message["data"]).get("model") == model:
            announced.append(json.loads(message["data"]))
    events.close()
    assert announced == [{"type": "routing", "model": model}] * 2


async def test_an_erroring_canary_is_rolled_back(registry: Registry, rds: redis.Redis, aredis: aioredis.Redis) -> None:
    model = make_model(registry, weights={"v1": 100.0})
    clock = Clock()
    rollout_id = start(registry, model, clock)
    controller = RolloutController(registry=registry, redis=aredis, clock=clock)
    clock.now += 1
    add_samples(rds, model, "v1", at=clock.now, n=400, seed=3, errors=4)
    add_samples(rds, model, "v2", at=clock.now, n=60, seed=4, errors=12)  # 20 % against 1 %
    clock.now += 10
    beat(rds, model, "v1", "v2", at=clock.now)
    [look] = await looks_at(controller, model)
    assert (look.decision.action, look.decision.reason) == ("rollback", "guardrail breach: error_rate")
    assert weights(registry, model) == {"v1": 100.0}
    [error_test] = [t for t in look.decision.evidence["tests"] if t["test"] == "error_rate"]
    assert error_test["breach"] and error_test["effect"] == pytest.approx(0.19)
    with registry.session() as session:
        row = session.get(Rollout, rollout_id)
        assert row is not None and row.state == "rolled_back"
        assert catalog.get_version(session, model, "v2").state == "staged"
    rows = decision_rows(registry, rollout_id)
    assert [r.action for r in rows] == ["start", "rollback"]
    assert rows[-1].evidence["correction"] == {
        "method": "always-valid",
        "tests_per_phase": 5,
        "phases": 3,
        "alpha": 0.05,
        "alpha_per_test": pytest.approx(0.05 / 15),
    }
    assert routing_audit(registry, model)[-1].reason.startswith(f"rollout {rollout_id} rolled back")


async def test_a_confidently_wrong_classifier_is_rolled_back_on_its_labels(
    registry: Registry, rds: redis.Redis, aredis: aioredis.Redis
) -> None:
    model = make_model(registry, kind="classifier")
    clock = Clock()
    start(registry, model, clock)
    controller = RolloutController(registry=registry, redis=aredis, clock=clock)
    clock.now += 1
    add_samples(rds, model, "v1", at=clock.now, n=3000, seed=5, labels=LABELS)
    add_samples(
        rds,
        model,
        "v2",
        at=clock.now,
        n=300,
        seed=6,
        labels={"billing": 0.1, "tech": 0.6, "account": 0.2, "other": 0.1},
    )
    clock.now += 10
    beat(rds, model, "v1", "v2", at=clock.now)
    [look] = await looks_at(controller, model)
    assert (look.decision.action, look.decision.reason) == ("rollback", "guardrail breach: label_shift")
    tests = {t["test"]: t for t in look.decision.evidence["tests"]}
    assert not tests["top_p"]["breach"] and not tests["latency"]["breach"]
    assert tests["label_shift"]["effect"] > POLICY.label_tvd_margin
    assert weights(registry, model) == {"v1": 100.0}


async def test_a_canary_without_live_workers_is_rolled_back_after_the_grace(
    registry: Registry, rds: redis.Redis, aredis: aioredis.Redis
) -> None:
    model = make_model(registry)
    clock = Clock()
    start(registry, model, clock)
    controller = RolloutController(registry=registry, redis=aredis, clock=clock)
    beat(rds, model, "v1", at=clock.now + 30)
    clock.now += 30
    [look] = await looks_at(controller, model)
    assert look.decision.action == "continue"
    clock.now += POLICY.worker_grace_s
    beat(rds, model, "v1", at=clock.now)
    [look] = await looks_at(controller, model)
    assert (look.decision.action, look.decision.reason) == ("rollback", "canary has no live worker")
    assert look.decision.evidence["live_workers"] == {"canary": 0, "stable": 1}


async def test_a_shadow_phase_passes_on_agreement_to_the_first_step(
    registry: Registry, rds: redis.Redis, aredis: aioredis.Redis
) -> None:
    model = make_model(registry, kind="classifier", states={"v1": "stable", "v2": "shadow"})
    clock = Clock()
    with pytest.raises(BadRequest, match="a shadow phase needs"):
        start(registry, model, clock)
    with registry.session() as session:  # 20 % of stable's jobs copied to the shadow
        routing_table.set_routing(session, model=model, weights={"v1": 100.0, "v2": 20.0}, actor="test", reason=None)
    rollout_id = start(registry, model, clock)
    assert weights(registry, model) == {"v1": 100.0, "v2": 20.0}, "the shadow phase keeps the copy rate"
    controller = RolloutController(registry=registry, redis=aredis, clock=clock)
    clock.now += 1
    add_samples(rds, model, "v1", at=clock.now, n=500, seed=7, labels=LABELS)
    add_samples(rds, model, "v2", at=clock.now, n=200, seed=8, labels=LABELS, agreement=0.99)
    clock.now += 60
    beat(rds, model, "v1", "v2", at=clock.now)
    [look] = await looks_at(controller, model)
    assert (look.decision.action, look.decision.to_step) == ("promote", 0), look.decision.reason
    assert "latency" not in {t["test"] for t in look.decision.evidence["tests"]}, "copies wait in the bulk lane"
    assert weights(registry, model) == {"v1": 90.0, "v2": 10.0}
    with registry.session() as session:
        assert catalog.get_version(session, model, "v2").state == "canary"
        rollouts.abort_rollout(session, model=model, actor="test", now=datetime.now(UTC))
    assert [r.step_index for r in decision_rows(registry, rollout_id)] == [-1, -1, 0]
    assert weights(registry, model) == {"v1": 100.0, "v2": 20.0}


async def test_a_shadow_that_disagrees_is_rolled_back_and_copies_stop(
    registry: Registry, rds: redis.Redis, aredis: aioredis.Redis
) -> None:
    model = make_model(
        registry, kind="classifier", weights={"v1": 100.0, "v2": 20.0}, states={"v1": "stable", "v2": "shadow"}
    )
    clock = Clock()
    start(registry, model, clock)
    controller = RolloutController(registry=registry, redis=aredis, clock=clock)
    clock.now += 1
    add_samples(rds, model, "v1", at=clock.now, n=500, seed=9, labels=LABELS)
    add_samples(rds, model, "v2", at=clock.now, n=200, seed=10, labels=LABELS, agreement=0.6)
    clock.now += 10
    beat(rds, model, "v1", "v2", at=clock.now)
    [look] = await looks_at(controller, model)
    assert (look.decision.action, look.decision.reason) == ("rollback", "guardrail breach: agreement")
    assert weights(registry, model) == {"v1": 100.0}, "a shadow percentage is not given to stable"
    with registry.session() as session:
        assert catalog.get_version(session, model, "v2").state == "staged"


async def test_abort_restores_the_weights_and_drops_a_stale_decision(
    registry: Registry, rds: redis.Redis, aredis: aioredis.Redis
) -> None:
    model = make_model(
        registry, weights={"v1": 70.0, "v3": 30.0}, states={"v1": "stable", "v2": "stable", "v3": "stable"}
    )
    clock = Clock()
    rollout_id = start(registry, model, clock)
    assert weights(registry, model) == {"v1": 90.0, "v2": 10.0}
    with registry.session() as session, pytest.raises(Conflict):
        rollouts.start_rollout(
            session, model=model, canary="v3", policy=POLICY.to_dict(), actor="test", now=datetime.now(UTC)
        )
    with registry.session() as session:
        rollouts.abort_rollout(session, model=model, actor="test", now=datetime.now(UTC), reason="changed my mind")
    assert weights(registry, model) == {"v1": 70.0, "v3": 30.0}
    with registry.session() as session:
        assert catalog.get_version(session, model, "v2").state == "stable", "the canary's state is restored"
        stale = rollouts.apply_decision(
            session,
            rollout_id=rollout_id,
            expected_step=0,
            action="promote",
            reason="late",
            evidence={},
            actor="test",
            now=datetime.now(UTC),
            to_step=1,
        )
    assert stale is None
    assert [r.action for r in decision_rows(registry, rollout_id)] == ["start", "abort"]
    controller = RolloutController(registry=registry, redis=aredis, clock=clock)
    assert await looks_at(controller, model) == []


def test_a_manual_rollback_after_a_completed_rollout_restores_the_replaced_version(
    registry: Registry, admin: httpx.Client
) -> None:
    model = make_model(registry)
    clock = Clock()
    rollout_id = start(registry, model, clock)
    for to_step in (1, 2):
        with registry.session() as session:
            applied = rollouts.apply_decision(
                session,
                rollout_id=rollout_id,
                expected_step=to_step - 1,
                action="promote",
                reason="healthy",
                evidence={},
                actor="test",
                now=datetime.now(UTC),
                to_step=to_step,
                final=to_step == 2,
            )
        assert applied is not None
    assert weights(registry, model) == {"v2": 100.0}

    rolled = admin.post(f"/v1/models/{model}/rollback", json={"reason": "v2 misbehaves at full traffic"})
    assert rolled.status_code == 200, rolled.text
    assert rolled.json()["routing"] == {"v1": 100.0}
    assert rolled.json()["audit"]["before"] == {"v2": 100.0}
    assert weights(registry, model) == {"v1": 100.0}
    with registry.session() as session:
        assert catalog.get_version(session, model, "v1").state == "stable"
        assert catalog.get_version(session, model, "v2").state == "staged", "the rolled-back version stops serving"
        [demoted] = session.scalars(
            select(AuditEntry).where(
                AuditEntry.model == model, AuditEntry.action == "version.update", AuditEntry.actor.startswith("key:")
            )
        )
    assert (demoted.before["state"], demoted.after["state"]) == ("stable", "staged")
    assert demoted.reason == f"v2 misbehaves at full traffic: back from 'v2', which rollout {rollout_id} promoted"
    assert routing_audit(registry, model)[-1].reason == "v2 misbehaves at full traffic"

    again = admin.post(f"/v1/models/{model}/rollback")
    assert again.status_code == 200, again.text
    assert again.json()["routing"] == {"v1": 100.0}, "a second rollback stays on the restored version"


def test_the_scheduler_process_runs_the_controller(registry: Registry, redis_url: str) -> None:
    from scheduler.main import Scheduler, autoscaler
    from sluice.settings import Settings

    model = make_model(registry)
    rollout_id = start(registry, model, Clock())
    scheduler = Scheduler(registry=registry, redis_url=redis_url, supervisor=None,
                          autoscaler=autoscaler(Settings(worker_slots=2)))
    thread = threading.Thread(target=scheduler.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while len(decision_rows(registry, rollout_id)) < 2:
            assert time.monotonic() < deadline, "the scheduler's controller took no look"
            time.sleep(0.1)
    finally:
        scheduler.request_stop()
        thread.join(timeout=20)
    assert not thread.is_alive()
    assert [r.action for r in decision_rows(registry, rollout_id)][:2] == ["start", "continue"]
    with registry.session() as session:
        rollouts.abort_rollout(session, model=model, actor="test", now=datetime.now(UTC))
