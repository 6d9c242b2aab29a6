"""A rollout in simulated time: synthetic traffic through the real guardrail decision.

Requests arrive as a Poisson process; each goes to the canary with the current step's weight
(in the shadow phase the candidate instead gets a copy of each request with `shadow_share`).
Every `policy.look_interval_s` the simulator builds each version's evidence over the step's
window, exactly as the controller does from the samples stream (capped like the stream), and
calls `decide`. The same seed gives the same rollout.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from scheduler.guardrails import Decision, Evidence, Position, decide
from sluice.registry.rollouts import SHADOW_STEP
from sluice.rollout_policy import Policy

STREAM_CAP = 20_000  # the workers' samples stream keeps about this many (workers/worker.py)


@dataclass(frozen=True, slots=True)
class VersionProfile:
    """How one version behaves: errors, lognormal total latency, and for a classifier its label
    distribution and Beta-distributed top probability."""

    error_rate: float = 0.01
    latency_median_ms: float = 40.0
    latency_sigma: float = 0.4
    labels: Mapping[str, float] = field(default_factory=dict)
    top_p_mean: float = 0.85
    top_p_concentration: float = 20.0
    agreement: float = 1.0  # chance a shadowed output agrees with the primary's
    live_workers: int = 1


@dataclass(frozen=True, slots=True)
class SimulatedDecision:
    at: float
    step: int
    decision: Decision


@dataclass(frozen=True, slots=True)
class SimulationResult:
    outcome: Literal["promoted", "rolled_back", "unfinished"]
    elapsed_s: float
    step: int  # where the rollout ended
    canary_samples: int  # in the window of the last decision: what the outcome was decided on
    canary_samples_total: int
    decisions: list[SimulatedDecision]


class _Window:
    """A version's samples since the step started, capped at the stream's length."""

    def __init__(self) -> None:
        self.errors: list[np.ndarray] = []
        self.latency: list[np.ndarray] = []
        self.top_p: list[np.ndarray] = []
        self.labels: list[np.ndarray] = []  # indices into label_names
        self.label_names: list[str] = []
        self.agreement: list[np.ndarray] = []

    def add(self, rng: np.random.Generator, profile: VersionProfile, n: int, *, shadow: bool) -> None:
        if n == 0:
            return
        failed = rng.random(n) < profile.error_rate
        self.errors.append(failed)
        ok = int(n - failed.sum())
        self.latency.append(rng.lognormal(np.log(profile.latency_median_ms), profile.latency_sigma, ok))
        if profile.labels:
            self.label_names = list(profile.labels)
            probs = np.asarray(list(profile.labels.values()), dtype=float)
            self.labels.append(rng.choice(len(probs), size=ok, p=probs / probs.sum()))
            a = profile.top_p_mean * profile.top_p_concentration
            self.top_p.append(rng.beta(a, profile.top_p_concentration - a, ok))
        if shadow:
            self.agreement.append((rng.random(ok) < profile.agreement).astype(float))

    def evidence(self, live_workers: int) -> Evidence:
        def tail(chunks: list[np.ndarray]) -> np.ndarray:
            return np.concatenate(chunks)[-STREAM_CAP:] if chunks else np.zeros(0)

        errors = tail(self.errors)
        counts = np.bincount(tail(self.labels).astype(int), minlength=len(self.label_names))
        return Evidence(
            requests=len(errors), errors=int(errors.sum()), latency_ms=tail(self.latency),
            top_p=tail(self.top_p), labels={k: int(c) for k, c in zip(self.label_names, counts, strict=True) if c},
            agreement=tail(self.agreement), live_workers=live_workers,
        )


def simulate(*, policy: Policy, stable: VersionProfile, canary: VersionProfile, seed: int,
             rate_per_s: float = 100.0, start_step: int = 0, shadow_share: float = 0.1,
             horizon_s: float = 6 * 3600.0) -> SimulationResult:
    """Run one rollout from `start_step` (SHADOW_STEP for a shadow phase first) until it is
    promoted, rolled back or `horizon_s` passes."""
    rng = np.random.default_rng(seed)
    now, step, step_started = 0.0, start_step, 0.0
    windows = (_Window(), _Window())
    decisions: list[SimulatedDecision] = []
    canary_total = last_canary = 0
    dt = policy.look_interval_s
    while now < horizon_s:
        arrivals = int(rng.poisson(rate_per_s * dt))
        if step == SHADOW_STEP:
            to_canary, to_stable = int(rng.binomial(arrivals, shadow_share)), arrivals
        else:
            to_canary = int(rng.binomial(arrivals, policy.steps[step] / 100))
            to_stable = arrivals - to_canary
        windows[0].add(rng, canary, to_canary, shadow=step == SHADOW_STEP)
        windows[1].add(rng, stable, to_stable, shadow=False)
        canary_total += to_canary
        now += dt
        canary_evidence = windows[0].evidence(canary.live_workers)
        last_canary = canary_evidence.requests
        decision = decide(now=now, canary=canary_evidence, stable=windows[1].evidence(stable.live_workers),
                          position=Position(step=step, step_started_at=step_started, started_at=0.0),
                          policy=policy)
        decisions.append(SimulatedDecision(at=now, step=step, decision=decision))
        if decision.action == "rollback":
            return SimulationResult("rolled_back", now, step, canary_evidence.requests, canary_total, decisions)
        if decision.action == "promote":
            assert decision.to_step is not None
            if decision.final:
                return SimulationResult("promoted", now, decision.to_step, canary_evidence.requests,
                                        canary_total, decisions)
            step, step_started, windows = decision.to_step, now, (_Window(), _Window())
    return SimulationResult("unfinished", now, step, last_canary, canary_total, decisions)
