"""The rollout controller: looks at each running rollout, decides, applies, records.

For each running rollout, once per `policy.look_interval_s`, it reads the canary's and stable's
samples over the current step's window (`sluice.wire.samples`) and their live workers
(`sluice.wire.heartbeats`), asks the pure `guardrails.decide`, and hands the decision to
`registry.rollouts.apply_decision`: the routing change (the same audited `set_routing` as the
admin API) and the decision row commit together. A routing change is then announced on
`sluice:events`, as the API does. Every look is recorded, `continue` included.

What would surprise a reader: the look interval is not part of the statistics (the guardrail's
tests are always valid, however many looks there are); it only bounds the controller's reads of
the samples streams, so the controller never looks more often than that, however often it is
ticked.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import redis.asyncio as aioredis

from scheduler.guardrails import Decision, Evidence, Position, decide
from sluice.errors import BrokerError, InvalidPolicy, SluiceError
from sluice.registry import rollouts
from sluice.registry.store import Registry
from sluice.rollout_policy import Policy
from sluice.wire import heartbeats
from sluice.wire.connections import connect
from sluice.wire.events import announce_routing
from sluice.wire.samples import Sample, read_samples

log = logging.getLogger(__name__)

ACTOR = "rollout-controller"


def evidence_from_samples(samples: Sequence[Sample], *, live_workers: int) -> Evidence:
    """Latency and quality proxies from succeeded jobs only (see `Evidence`)."""
    ok = [s for s in samples if s.succeeded]
    return Evidence(
        requests=len(samples),
        errors=len(samples) - len(ok),
        latency_ms=[s.total_ms for s in ok],
        top_p=[float(s.quality["top_p"]) for s in ok if "top_p" in s.quality],
        labels=dict(Counter(str(s.quality["label"]) for s in ok if "label" in s.quality)),
        agreement=[float(s.quality["agreement"]) for s in ok if "agreement" in s.quality],
        live_workers=live_workers,
    )


@dataclass(frozen=True, slots=True)
class Active:
    """A running rollout as read at the start of a look (the row itself stays in the registry)."""

    id: int
    model: str
    canary: str
    stable: str
    policy: Policy
    step: int
    step_started_at: float
    started_at: float


@dataclass(frozen=True, slots=True)
class Look:
    rollout_id: int
    model: str
    step: int
    decision: Decision
    applied: rollouts.Applied | None  # None: the rollout moved on meanwhile, nothing was written


class RolloutController:
    def __init__(
        self, *, registry: Registry, redis: aioredis.Redis, clock: Callable[[], float] = time.time, actor: str = ACTOR
    ) -> None:
        self.registry = registry
        self.redis = redis
        self.clock = clock
        self.actor = actor
        self._last_look: dict[int, float] = {}

    def _running(self) -> list[Active]:
        with self.registry.session() as session:
            rows = rollouts.running_rollouts(session)
        active = []
        for row in rows:
            try:
                policy = Policy.from_dict(row.policy)
            except (InvalidPolicy, TypeError, ValueError) as exc:
                log.error("rollout %s of %s has an unusable policy, skipping it: %s", row.id, row.model, exc)
                continue
            active.append(
                Active(
                    id=row.id,
                    model=row.model,
                    canary=row.canary,
                    stable=row.stable,
                    policy=policy,
                    step=row.step_index,
                    step_started_at=row.step_started_at.timestamp(),
                    started_at=row.started_at.timestamp(),
                )
            )
        return active

    async def _evidence(self, model: str, version: str, *, since: float, now: float) -> Evidence:
        samples = await read_samples(self.redis, model, version, window_s=max(0.0, now - since), now=now)
        live = await heartbeats.live_count(self.redis, model, version, now=now)
        return evidence_from_samples(samples, live_workers=live)

    async def look(self, rollout: Active) -> Look:
        now = self.clock()
        canary = await self._evidence(rollout.model, rollout.canary, since=rollout.step_started_at, now=now)
        stable = await self._evidence(rollout.model, rollout.stable, since=rollout.step_started_at, now=now)
        decision = decide(
            now=now,
            canary=canary,
            stable=stable,
            policy=rollout.policy,
            position=Position(
                step=rollout.step, step_started_at=rollout.step_started_at, started_at=rollout.started_at
            ),
        )

        def apply() -> rollouts.Applied | None:
            with self.registry.session() as session:
                return rollouts.apply_decision(
                    session,
                    rollout_id=rollout.id,
                    expected_step=rollout.step,
                    action=decision.action,
                    reason=decision.reason,
                    evidence=decision.evidence,
                    actor=self.actor,
                    now=datetime.fromtimestamp(now, UTC),
                    to_step=decision.to_step,
                    final=decision.final,
                )

        applied = await asyncio.to_thread(apply)
        self._last_look[rollout.id] = now
        if applied is not None and decision.action != "continue":
            log.info(
                "rollout %s of %s: %s at step %s: %s",
                rollout.id,
                rollout.model,
                decision.action,
                rollout.step,
                decision.reason,
            )
        if applied is not None and applied.routing_changed:
            try:
                await announce_routing(self.redis, rollout.model)
            except BrokerError as exc:
                log.warning(
                    "could not announce the routing change of %s (replicas reload it on their periodic refresh): %s",
                    rollout.model,
                    exc,
                )
        return Look(rollout_id=rollout.id, model=rollout.model, step=rollout.step, decision=decision, applied=applied)

    async def tick(self) -> list[Look]:
        """Look at every running rollout whose look interval has passed."""
        active = await asyncio.to_thread(self._running)
        now = self.clock()
        running = {r.id for r in active}
        self._last_look = {k: v for k, v in self._last_look.items() if k in running}
        looks = []
        for rollout in active:
            last = self._last_look.get(rollout.id)
            if last is not None and now - last < rollout.policy.look_interval_s:
                continue
            try:
                looks.append(await self.look(rollout))
            except SluiceError as exc:
                log.warning(
                    "rollout %s of %s: look failed, retrying on the next tick: %s", rollout.id, rollout.model, exc
                )
        return looks

    async def run(self, *, stopping: threading.Event, poll_s: float = 2.0) -> None:
        while not stopping.is_set():
            try:
                await self.tick()
            except SluiceError as exc:
                log.warning("rollout controller: the registry or Redis failed, retrying: %s", exc)
            await asyncio.to_thread(stopping.wait, poll_s)


def run_controller(*, registry: Registry, redis_url: str, stopping: threading.Event, poll_s: float = 2.0) -> None:
    """The scheduler's entry point: the controller on an event loop of its own until `stopping`."""

    async def main() -> None:
        client = connect(redis_url, max_connections=4)
        try:
            await RolloutController(registry=registry, redis=client).run(stopping=stopping, poll_s=poll_s)
        finally:
            await client.aclose()

    asyncio.run(main())
