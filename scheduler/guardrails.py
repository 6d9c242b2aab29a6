"""The rollout guardrail: a pure decision over a canary's and stable's evidence.

`decide` takes the clock value, the two versions' evidence over the current step's window, the
rollout's position and a `Policy` (`sluice.rollout_policy`), and answers promote, rollback or continue with every test's
statistic, p-value, effect and threshold as a JSON-able dict. The controller and the simulator
call it the same way, so its error rates can be measured in simulated time.

What would surprise a reader: a rollback needs a difference that is both significant and larger
than a practical margin, and significance is always-valid (`scheduler.sequential`): each test's
p-value may be looked at after every sample without correction, so the controller may look as
often and as long as it likes (while a step soaks, while it waits for `min_samples`, in the
shadow phase). Alpha is split evenly, once, over the tests a phase can run and the phases a
rollout can pass through, so identical versions roll back with probability at most `alpha` over
a whole rollout, before the margins cut that further. Hard breaches (a canary with no live
worker, an error rate over the ceiling) need no statistics and act at once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

import numpy as np
import numpy.typing as npt

from scheduler.sequential import (
    bounded_mean_p,
    effective_samples,
    label_split_p,
    normal_mixture_p,
    rate_ratio_p,
)
from sluice.registry.rollouts import SHADOW_STEP
from sluice.rollout_policy import TESTS_PER_PHASE, Policy

Action = Literal["promote", "rollback", "continue"]
Values: TypeAlias = Sequence[float] | npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class Evidence:
    """One version over the step's window. Latency and quality are over succeeded jobs only:
    a failure is usually fast, and counting it would make an error spike look like a speed-up."""

    requests: int = 0
    errors: int = 0
    latency_ms: Values = ()
    top_p: Values = ()
    labels: Mapping[str, int] = field(default_factory=dict)
    agreement: Values = ()
    live_workers: int = 1


@dataclass(frozen=True, slots=True)
class Position:
    step: int  # index into Policy.steps, or SHADOW_STEP
    step_started_at: float
    started_at: float


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    reason: str
    evidence: dict[str, Any]
    to_step: int | None = None  # the step a promote moves to
    final: bool = False  # a promote to 100 %: the canary becomes stable


# --- statistics -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StatResult:
    """A test at one look: its statistic, its always-valid p-value and how it was computed."""

    statistic: float | None
    p_value: float
    method: str


def _finite(value: float | None, digits: int = 6) -> float | None:
    """JSON (and Postgres JSONB) has no NaN or infinity."""
    if value is None or not math.isfinite(value):
        return None
    return round(float(value), digits)


def event_rate_greater(x1: int, n1: int, x2: int, n2: int) -> StatResult:
    """One-sided, always valid: events (x of n) more frequent in the first sample than in the
    second. The statistic is the rate ratio."""
    if n1 == 0 or n2 == 0:
        return StatResult(None, 1.0, "none")
    ratio = (x1 / n1) / (x2 / n2) if x2 else (math.inf if x1 else None)
    return StatResult(ratio, rate_ratio_p(x1, n1, x2, n2), "rate-ratio mixture")


def rank_test_greater(x: Values, y: Values) -> tuple[StatResult, float]:
    """Mann-Whitney U, one-sided (x stochastically greater than y): z by the normal approximation
    with tie and continuity correction, made always valid by the normal mixture. Answers the
    test and U / (n1 n2), the probability that a random x exceeds a random y (ties count half)."""
    n1, n2 = len(x), len(y)
    if n1 == 0 or n2 == 0:
        return StatResult(None, 1.0, "none"), 0.5
    xs, ys = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    ordered = np.sort(np.concatenate([xs, ys]))
    n = n1 + n2
    # A value's rank is the mean of the positions its tie block spans (1-based). Ranking the
    # smaller sample is enough (U1 + U2 = n1 n2), and a canary is usually far smaller than stable.
    small = xs if n1 <= n2 else ys
    rank_sum = float(np.sum(np.searchsorted(ordered, small, "left") + np.searchsorted(ordered, small, "right") + 1)) / 2
    u_small = rank_sum - len(small) * (len(small) + 1) / 2
    u1 = u_small if n1 <= n2 else n1 * n2 - u_small
    ties = np.diff(np.concatenate(([0], np.flatnonzero(np.diff(ordered)) + 1, [n]))).astype(float)
    tie_term = float(np.sum(ties**3 - ties)) / (n * (n - 1)) if n > 1 else 0.0
    variance = n1 * n2 / 12 * ((n + 1) - tie_term)
    superiority = u1 / (n1 * n2)
    if variance <= 0:
        return StatResult(0.0, 1.0, "mann-whitney mixture"), superiority
    z = (u1 - n1 * n2 / 2 - 0.5) / math.sqrt(variance)
    return StatResult(z, normal_mixture_p(z, effective_samples(n1, n2)), "mann-whitney mixture"), superiority


def total_variation(a: Mapping[str, int], b: Mapping[str, int]) -> float:
    na, nb = sum(a.values()), sum(b.values())
    if na == 0 or nb == 0:
        return 0.0
    return 0.5 * sum(abs(a.get(k, 0) / na - b.get(k, 0) / nb) for k in set(a) | set(b))


def label_shift(a: Mapping[str, int], b: Mapping[str, int]) -> StatResult:
    """Any difference between two label distributions, always valid, from the counts per label
    (`sequential.label_split_p`: exact, so rare labels need no pooling)."""
    if not sum(a.values()) or not sum(b.values()):
        return StatResult(None, 1.0, "none")
    labels = sorted(set(a) | set(b))
    p = label_split_p([a.get(k, 0) for k in labels], [b.get(k, 0) for k in labels])
    return StatResult(None, p, "beta-binomial mixture")


# --- the decision ---------------------------------------------------------------------------------


def _median(values: Values) -> float | None:
    return float(np.median(np.asarray(values, dtype=float))) if len(values) else None


def _comparisons(canary: Evidence, stable: Evidence, policy: Policy, *, shadow: bool) -> list[dict[str, Any]]:
    """Each test that has enough samples on both sides, before alpha is applied. Shadow copies
    wait in the bulk lane behind their primary, so their latency is not compared."""
    out: list[dict[str, Any]] = []
    least = policy.min_test_samples

    def add(
        name: str, result: StatResult, effect: float | None, margin: float, n_canary: int, n_stable: int, **extra: Any
    ) -> None:
        out.append(
            {
                "test": name,
                "method": result.method,
                "statistic": _finite(result.statistic),
                "p_value": result.p_value,
                "effect": _finite(effect),
                "margin": margin,
                "n_canary": n_canary,
                "n_stable": n_stable,
                **extra,
            }
        )

    if min(canary.requests, stable.requests) >= least:
        rate_c, rate_s = canary.errors / canary.requests, stable.errors / stable.requests
        add(
            "error_rate",
            event_rate_greater(canary.errors, canary.requests, stable.errors, stable.requests),
            rate_c - rate_s,
            policy.error_margin,
            canary.requests,
            stable.requests,
            canary=_finite(rate_c),
            stable=_finite(rate_s),
        )
    if not shadow and min(len(canary.latency_ms), len(stable.latency_ms)) >= least:
        result, superiority = rank_test_greater(canary.latency_ms, stable.latency_ms)
        med_c, med_s = _median(canary.latency_ms), _median(stable.latency_ms)
        effect = med_c / med_s - 1 if med_c is not None and med_s else None
        add(
            "latency",
            result,
            effect,
            policy.latency_margin,
            len(canary.latency_ms),
            len(stable.latency_ms),
            canary_p50_ms=_finite(med_c, 3),
            stable_p50_ms=_finite(med_s, 3),
            canary_p99_ms=_finite(float(np.percentile(canary.latency_ms, 99)), 3),
            stable_p99_ms=_finite(float(np.percentile(stable.latency_ms, 99)), 3),
            prob_canary_slower=_finite(superiority),
        )
    if min(len(canary.top_p), len(stable.top_p)) >= least:
        result, superiority = rank_test_greater(stable.top_p, canary.top_p)
        mean_c, mean_s = float(np.mean(canary.top_p)), float(np.mean(stable.top_p))
        add(
            "top_p",
            result,
            mean_s - mean_c,
            policy.top_p_margin,
            len(canary.top_p),
            len(stable.top_p),
            canary_mean=_finite(mean_c),
            stable_mean=_finite(mean_s),
            prob_canary_lower=_finite(superiority),
        )
        low_c = int(np.sum(np.asarray(canary.top_p) < policy.low_confidence_threshold))
        low_s = int(np.sum(np.asarray(stable.top_p) < policy.low_confidence_threshold))
        n_c, n_s = len(canary.top_p), len(stable.top_p)
        add(
            "low_confidence",
            event_rate_greater(low_c, n_c, low_s, n_s),
            low_c / n_c - low_s / n_s,
            policy.low_confidence_margin,
            n_c,
            n_s,
            threshold=policy.low_confidence_threshold,
            canary=_finite(low_c / n_c),
            stable=_finite(low_s / n_s),
        )
    n_labels_c, n_labels_s = sum(canary.labels.values()), sum(stable.labels.values())
    if min(n_labels_c, n_labels_s) >= least:
        add(
            "label_shift",
            label_shift(canary.labels, stable.labels),
            total_variation(canary.labels, stable.labels),
            policy.label_tvd_margin,
            n_labels_c,
            n_labels_s,
            canary_counts=dict(canary.labels),
        )
    return out


def _agreement(canary: Evidence, policy: Policy) -> dict[str, Any] | None:
    """Agreement with the primary on shadowed inputs, against the bar rather than stable, both
    ways: below it is a breach (at the per-test alpha); above it is the shadow phase's gate (at
    the whole alpha: its error is a promotion, of which a rollout makes at most one from there)."""
    n = len(canary.agreement)
    if n < policy.min_test_samples:
        return None
    below = bounded_mean_p(canary.agreement, policy.min_agreement, below=True)
    above = bounded_mean_p(canary.agreement, policy.min_agreement, below=False)
    return {
        "test": "agreement",
        "method": "betting",
        "mean": _finite(float(np.mean(canary.agreement))),
        "n_canary": n,
        "bar": policy.min_agreement,
        "p_value": _finite(below, 12),
        "alpha": policy.alpha_per_test,
        "breach": below <= policy.alpha_per_test,
        "p_above_bar": _finite(above, 12),
        "gate_alpha": policy.alpha,
        "meets_bar": above <= policy.alpha,
    }


def decide(*, now: float, canary: Evidence, stable: Evidence, position: Position, policy: Policy) -> Decision:
    step = position.step
    weight = 0.0 if step == SHADOW_STEP else policy.steps[step]
    elapsed = max(0.0, now - position.step_started_at)
    evidence: dict[str, Any] = {
        "at": now,
        "step": step,
        "weight": weight,
        "soak": {"elapsed_s": round(elapsed, 3), "required_s": policy.soak_s},
        "samples": {"canary": canary.requests, "stable": stable.requests, "required": policy.min_samples},
        "live_workers": {"canary": canary.live_workers, "stable": stable.live_workers},
    }

    def rollback(reason: str) -> Decision:
        return Decision(action="rollback", reason=reason, evidence=evidence)

    if canary.live_workers <= 0 and now - position.started_at >= policy.worker_grace_s:
        return rollback("canary has no live worker")
    if canary.requests >= policy.hard_min_requests and canary.errors / canary.requests > policy.hard_error_rate:
        return rollback(
            f"canary error rate {canary.errors / canary.requests:.3f} is over the hard ceiling {policy.hard_error_rate}"
        )

    tests = _comparisons(canary, stable, policy, shadow=step == SHADOW_STEP)
    alpha = policy.alpha_per_test
    for test in tests:
        test["alpha"] = alpha
        test["significant"] = test["p_value"] <= alpha
        test["breach"] = test["significant"] and test["effect"] is not None and test["effect"] > test["margin"]
        test["p_value"] = _finite(test["p_value"], 12)
    agreement = _agreement(canary, policy)
    if agreement is not None:
        tests.append(agreement)
    evidence["tests"] = tests
    evidence["correction"] = {
        "method": "always-valid",
        "tests_per_phase": TESTS_PER_PHASE,
        "phases": policy.phases,
        "alpha": policy.alpha,
        "alpha_per_test": alpha,
    }

    breached = [t["test"] for t in tests if t["breach"]]
    if breached:
        return rollback(f"guardrail breach: {', '.join(breached)}")

    waiting: list[str] = []
    if elapsed < policy.soak_s:
        waiting.append(f"soaking {elapsed:.0f}/{policy.soak_s:.0f} s")
    if canary.requests < policy.min_samples:
        waiting.append(f"canary samples {canary.requests}/{policy.min_samples}")
    if stable.requests < policy.min_samples:
        waiting.append(f"stable samples {stable.requests}/{policy.min_samples}")
    if step == SHADOW_STEP:
        if agreement is None:
            waiting.append(f"agreement samples {len(canary.agreement)}/{policy.min_test_samples}")
        elif len(canary.agreement) < policy.min_samples:
            waiting.append(f"agreement samples {len(canary.agreement)}/{policy.min_samples}")
        elif not agreement["meets_bar"]:
            waiting.append(
                f"agreement {agreement['mean']} not yet shown above {policy.min_agreement} "
                f"(p {agreement['p_above_bar']:.3g})"
            )
    if waiting:
        return Decision(action="continue", reason="; ".join(waiting), evidence=evidence)
    to_step = step + 1
    final = to_step == len(policy.steps) - 1
    return Decision(
        action="promote",
        to_step=to_step,
        final=final,
        evidence=evidence,
        reason=f"no breach after {elapsed:.0f} s and {canary.requests} canary samples: "
        + ("canary becomes stable" if final else f"to {policy.steps[to_step]:g} %"),
    )
