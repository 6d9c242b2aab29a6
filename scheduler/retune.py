"""The re-tune job: for every version with a p99 budget, plan its batching again on what it serves.

For each such version it reads the mix of the last 24 hours (every lane) and the recorded forward
passes from Redis (sluice/wire/mix.py), fits the cost model to the passes
(`frontier.fit_cost`), runs the frontier in the simulator on that mix
(`scheduler.planning.retune.plan`) and keeps the proposal on the version. With `auto_tune`, a
proposal worth applying (`Proposal.worth_applying` at `retune_min_gain`) is applied as the PATCH
applies a batching change (`sluice.registry.tuning.apply_proposal`, audited, then a routing event
so the scheduler replaces the version's workers); otherwise `sluice tune status` and the version's
`batching.proposal` show it for a person to apply.

Beat sends it nightly (`sluice.retune`, scheduler/retune_task.py). A version is skipped, its last
proposal kept, while it has too little to plan on: fewer than `MIN_SAMPLES` inputs in the window
or `MIN_PASSES` recorded passes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import redis.asyncio as aioredis

from scheduler.planning.frontier import fit_cost
from scheduler.planning.retune import DEFAULT_GRID, Grid, Proposal, plan
from sluice.registry import tuning
from sluice.registry.store import Registry
from sluice.wire import events
from sluice.wire import mix as wire_mix

log = logging.getLogger(__name__)

ACTOR = "scheduler:retune"
MIN_SAMPLES = 100
MIN_PASSES = 20


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the job did for one version: `proposed`, `applied`, or `skipped` with why."""

    model: str
    version: str
    action: str
    detail: str = ""
    proposal: dict[str, Any] | None = None


async def retune_all(*, registry: Registry, redis: aioredis.Redis, min_gain: float, batch_timeout_s: float,
                     clock: Callable[[], float], grid: Grid = DEFAULT_GRID) -> list[Outcome]:
    now = clock()
    with registry.session() as session:
        budgeted = [(version, version.p99_budget_ms) for version in tuning.served(session)
                    if version.p99_budget_ms is not None]
    outcomes = []
    for version, budget_ms in budgeted:
        outcome = await _retune(version, budget_ms, registry=registry, redis=redis, min_gain=min_gain,
                                batch_timeout_s=batch_timeout_s, now=now, grid=grid)
        log.info("re-tune of %s/%s: %s %s", version.model, version.version, outcome.action, outcome.detail,
                 extra={"model": version.model, "version": version.version, "action": outcome.action})
        outcomes.append(outcome)
    return outcomes


async def _retune(version: tuning.Tuning, budget_ms: float, *, registry: Registry, redis: aioredis.Redis,
                  min_gain: float, batch_timeout_s: float, now: float, grid: Grid) -> Outcome:
    hours = await wire_mix.read_hours(redis, version.model, version.version)
    mix = wire_mix.recent_mix(hours, now_hour=wire_mix.hour_of(now))
    if mix.total < MIN_SAMPLES:
        return Outcome(version.model, version.version, "skipped", f"{mix.total} inputs in the last "
                       f"{wire_mix.RECENT_HOURS} h, fewer than {MIN_SAMPLES}")
    passes = await wire_mix.read_passes(redis, version.model, version.version)
    if len(passes) < MIN_PASSES:
        return Outcome(version.model, version.version, "skipped", f"{len(passes)} recorded passes, fewer than "
                       f"{MIN_PASSES}")
    fit = fit_cost([(p.size, p.longest, p.seconds) for p in passes])
    on = {"mix": mix.to_mapping(), "samples": mix.total, "window_h": wire_mix.RECENT_HOURS,
          "until": datetime.fromtimestamp(now, tz=UTC).isoformat(), "passes": len(passes), "fit": fit.describe()}
    proposal = await asyncio.to_thread(
        plan, mix=mix, cost=fit.cost, p99_budget_ms=budget_ms, max_batch_size=version.max_batch_size,
        max_wait_ms=version.max_wait_ms, now=now, grid=grid, on=on)
    document = proposal.to_dict() if proposal is not None else None
    with registry.session() as session:
        tuning.record_proposal(session, model=version.model, version=version.version, proposal=document)
    if proposal is None:
        return Outcome(version.model, version.version, "skipped",
                       f"no setting of the grid meets the p99 budget of {budget_ms:g} ms")
    if version.auto_tune and proposal.worth_applying(max_batch_size=version.max_batch_size,
                                                     max_wait_ms=version.max_wait_ms, min_gain=min_gain):
        with registry.session() as session:
            tuning.apply_proposal(session, model=version.model, version=version.version, actor=ACTOR,
                                  reason=_reason(proposal), now=datetime.fromtimestamp(now, tz=UTC),
                                  batch_timeout_s=batch_timeout_s)
        await events.announce_routing(redis, version.model)
        return Outcome(version.model, version.version, "applied", _reason(proposal), document)
    return Outcome(version.model, version.version, "proposed", _reason(proposal), document)


def _reason(proposal: Proposal) -> str:
    gain = "the current setting never meets the budget" if proposal.gain is None else f"gain {proposal.gain:+.1%}"
    return (f"re-tuned on the served mix: batch {proposal.max_batch_size}, wait {proposal.max_wait_ms:g} ms, "
            f"{proposal.throughput_rps:.1f}/s at p99 {proposal.p99_ms:.0f} ms within {proposal.p99_budget_ms:g} ms "
            f"({gain})")
