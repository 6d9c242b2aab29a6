"""The guardrail decision: its statistics against known values, and whole rollouts in simulated
time (identical versions promote; a canary that is worse in one way rolls back)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import stats as sps
from scipy.special import betaln

from scheduler.guardrails import (
    SHADOW_STEP,
    Evidence,
    Position,
    decide,
    event_rate_greater,
    label_shift,
    rank_test_greater,
    total_variation,
)
from scheduler.rollout_sim import VersionProfile, simulate
from scheduler.sequential import (
    BET_FRACTIONS,
    LABEL_SPREAD,
    MIXTURE_SAMPLES,
    RATE_RATIOS,
    bounded_mean_p,
    label_split_p,
    normal_mixture_p,
    rate_ratio_p,
)
from sluice.errors import InvalidPolicy
from sluice.rollout_policy import STEP_TESTS, TESTS_PER_PHASE, Policy

LABELS = {"billing": 0.4, "tech": 0.3, "account": 0.2, "other": 0.1}
CLASSIFIER = VersionProfile(error_rate=0.01, labels=LABELS)
# Fewer looks than the default keeps 20 simulated rollouts to a few seconds of CPU.
FAST = Policy(soak_s=300, look_interval_s=30)


# --- statistics against known values ---------------------------------------------------------------


def test_the_event_rate_test_is_the_rate_ratio_mixture() -> None:
    # 12 of 100 against 10 of 1000: share 1/11, 22 events; M = mean of psi^12 / (1 + (psi - 1) / 11)^22.
    by_hand = np.mean([psi**12 / (1 + (psi - 1) / 11) ** 22 for psi in RATE_RATIOS])
    result = event_rate_greater(12, 100, 10, 1000)
    assert (result.method, result.statistic) == ("rate-ratio mixture", pytest.approx(12.0))
    assert result.p_value == pytest.approx(1 / by_hand, rel=1e-9) and result.p_value < 1e-5
    # Events in proportion to the samples, or fewer in the first, are no evidence at all.
    assert event_rate_greater(10, 1000, 100, 10_000).p_value == 1.0
    assert event_rate_greater(0, 500, 50, 5000).p_value == 1.0
    assert event_rate_greater(0, 500, 0, 5000).p_value == 1.0
    assert event_rate_greater(3, 100, 0, 0).p_value == 1.0


def test_the_normal_mixture_by_hand() -> None:
    # z = 4 on 20 effective samples (r = 1): M = 2 / sqrt(2) * exp(4) * Phi(4 / sqrt(2)).
    by_hand = 2 / math.sqrt(2) * math.exp(16 * 0.5 / 2) * sps.norm.cdf(4 * math.sqrt(0.5))
    assert normal_mixture_p(4.0, MIXTURE_SAMPLES) == pytest.approx(1 / by_hand, rel=1e-9)
    assert normal_mixture_p(-4.0, 1000) == 1.0 and normal_mixture_p(None, 1000) == 1.0
    # The price of unlimited looks: far stricter than the fixed-sample z of 2.81 at 0.0025.
    assert normal_mixture_p(3.3, 200) > 0.0025 > normal_mixture_p(4.0, 200)


def test_mann_whitney_by_hand_and_with_ties() -> None:
    # x = 3, 4, 5 above y = 1, 2: ranks 3+4+5, U = 12 - 6 = 6 = n1*n2; var = 3*2*6/12 = 3.
    result, superiority = rank_test_greater([3, 4, 5], [1, 2])
    assert superiority == 1.0
    assert result.statistic == pytest.approx(2.5 / math.sqrt(3), abs=1e-9)
    assert result.p_value == pytest.approx(normal_mixture_p(2.5 / math.sqrt(3), 3 * 2 / 5), rel=1e-12)
    rng = np.random.default_rng(7)
    x, y = rng.integers(0, 6, 70).astype(float), rng.integers(0, 5, 90).astype(float)  # many ties
    ours, _ = rank_test_greater(x.tolist(), y.tolist())
    reference = sps.mannwhitneyu(x, y, alternative="greater", method="asymptotic", use_continuity=True)
    assert ours.statistic is not None
    assert sps.norm.sf(ours.statistic) == pytest.approx(float(reference.pvalue), rel=1e-9)
    assert rank_test_greater([1.0] * 60, [1.0] * 60)[0].p_value == 1.0


def test_label_shift_is_a_product_of_beta_binomial_mixtures_and_total_variation_by_hand() -> None:
    canary, stable = {"a": 30, "b": 10, "c": 1}, {"a": 100, "b": 300}
    share = 41 / 441
    k = (1 - share) / (LABEL_SPREAD**2 * share) - 1
    log_e = sum(
        betaln(share * k + x, (1 - share) * k + y)
        - betaln(share * k, (1 - share) * k)
        - x * math.log(share)
        - y * math.log(1 - share)
        for x, y in ((30, 100), (10, 300), (1, 0))
    )
    result = label_shift(canary, stable)
    assert result.p_value == pytest.approx(math.exp(-log_e), rel=1e-9) and result.p_value < 1e-6
    assert label_shift({"a": 10, "b": 30}, {"a": 100, "b": 300}).p_value == 1.0
    assert label_shift({}, {"a": 1}).p_value == 1.0
    assert total_variation({"a": 5, "b": 5}, {"a": 8, "b": 2}) == pytest.approx(0.3)
    assert total_variation({"a": 1}, {"b": 1}) == pytest.approx(1.0)


def test_bounded_mean_by_hand() -> None:
    # Against a bar of 0.5, values 0, 0 and 1: a fraction c stakes c / 0.5 per unit of distance.
    below = np.mean([(1 + c) ** 2 * (1 - c) for c in BET_FRACTIONS])
    above = np.mean([(1 - c) ** 2 * (1 + c) for c in BET_FRACTIONS])
    assert bounded_mean_p([0.0, 0.0, 1.0], 0.5, below=True) == pytest.approx(min(1.0, 1 / below), rel=1e-12)
    assert bounded_mean_p([0.0, 0.0, 1.0], 0.5, below=False) == 1.0 == pytest.approx(min(1.0, 1 / above))
    assert bounded_mean_p([0.6] * 200, 0.9, below=True) < 1e-6
    assert bounded_mean_p([0.99] * 200, 0.9, below=False) < 1e-6
    assert bounded_mean_p([], 0.9, below=True) == 1.0


def test_the_tests_stay_valid_under_continuous_monitoring() -> None:
    """Under each null, looked at every 20 samples up to 400, each test rejects at alpha = 0.1 on at
    most 10 % of 400 paths (Ville's inequality; they reject on 1 to 4 %). A fixed-sample z-test at
    the same alpha, looked at as often, rejects on about a third."""
    rng = np.random.default_rng(13)
    alpha, paths, n = 0.1, 400, 400
    # Events, and samples of each of 3 labels, falling into a 10 % canary; Gaussian increments for
    # the normal mixture; agreement at exactly the bar.
    in_canary = rng.random((paths, n)) < 0.1
    canary_events = np.cumsum(in_canary, axis=1)
    by_label = np.eye(3, dtype=int)[rng.integers(0, 3, (paths, n))]
    canary_labels = np.cumsum(by_label * in_canary[..., None], axis=1)
    all_labels = np.cumsum(by_label, axis=1)
    z_walk = np.cumsum(rng.normal(size=(paths, n)), axis=1) / np.sqrt(np.arange(1, n + 1))
    agreement = rng.random((paths, n)) < 0.9
    rejected = {"rate": 0, "normal": 0, "bounded": 0, "labels": 0, "fixed": 0}
    for path in range(paths):
        hits = set()
        for i in range(19, n, 20):
            x = int(canary_events[path, i])
            if rate_ratio_p(x, 100, i + 1 - x, 900) <= alpha:
                hits.add("rate")
            x_labels = canary_labels[path, i]
            if label_split_p(x_labels.tolist(), (all_labels[path, i] - x_labels).tolist()) <= alpha:
                hits.add("labels")
            if normal_mixture_p(float(z_walk[path, i]), i + 1) <= alpha:
                hits.add("normal")
            if sps.norm.sf(z_walk[path, i]) <= alpha:
                hits.add("fixed")
            if bounded_mean_p(agreement[path, : i + 1], 0.9, below=True) <= alpha:
                hits.add("bounded")
        for name in hits:
            rejected[name] += 1
    assert max(rejected[k] for k in ("rate", "normal", "bounded", "labels")) <= alpha * paths, rejected
    assert rejected["fixed"] > 2 * alpha * paths, rejected


# --- the policy -----------------------------------------------------------------------------------


def test_policy_validates_and_round_trips() -> None:
    policy = Policy(steps=(2, 10, 100), soak_s=60, min_samples=100)
    assert Policy.from_dict(json.loads(json.dumps(policy.to_dict()))) == policy
    for bad in ({"steps": (5, 1, 100)}, {"steps": (1, 50)}, {"steps": (100,)}, {"alpha": 0}, {"min_samples": 10}):
        with pytest.raises(InvalidPolicy):
            Policy(**bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidPolicy, match="unknown"):
        Policy.from_dict({"soak": 1})
    # Alpha is shared once over the tests of a phase and the phases (the steps below 100 % and a
    # shadow phase), however many looks there are: the look interval plays no part.
    assert policy.alpha_per_test == pytest.approx(0.05 / (TESTS_PER_PHASE * 3))
    assert Policy(look_interval_s=1).alpha_per_test == Policy(look_interval_s=60).alpha_per_test


# --- single decisions -----------------------------------------------------------------------------


def _evidence(
    rng: np.random.Generator, n: int, *, errors: float = 0.01, latency: float = 40.0, live: int = 1
) -> Evidence:
    failed = int(round(n * errors))
    return Evidence(
        requests=n,
        errors=failed,
        latency_ms=rng.lognormal(math.log(latency), 0.3, n - failed).tolist(),
        live_workers=live,
    )


def test_not_enough_samples_continues() -> None:
    rng = np.random.default_rng(1)
    policy = Policy()
    decision = decide(
        now=1000.0,
        canary=_evidence(rng, 120),
        stable=_evidence(rng, 9000),
        position=Position(step=0, step_started_at=0.0, started_at=0.0),
        policy=policy,
    )
    assert decision.action == "continue"
    assert "canary samples 120/200" in decision.reason
    json.dumps(decision.evidence, allow_nan=False)
    # Below min_test_samples nothing is even tested, however bad it looks.
    decision = decide(
        now=10.0,
        canary=_evidence(rng, 30, latency=400.0),
        stable=_evidence(rng, 9000),
        position=Position(step=0, step_started_at=0.0, started_at=0.0),
        policy=policy,
    )
    assert decision.action == "continue" and decision.evidence["tests"] == []


def test_soak_time_is_required_as_well_as_samples() -> None:
    rng = np.random.default_rng(2)
    position = Position(step=1, step_started_at=0.0, started_at=-500.0)
    early = decide(
        now=100.0, canary=_evidence(rng, 400), stable=_evidence(rng, 8000), position=position, policy=Policy()
    )
    assert early.action == "continue" and "soaking 100/300 s" in early.reason
    later = decide(
        now=300.0, canary=_evidence(rng, 400), stable=_evidence(rng, 8000), position=position, policy=Policy()
    )
    assert (later.action, later.to_step, later.final) == ("promote", 2, False)
    last = decide(
        now=300.0,
        canary=_evidence(rng, 400),
        stable=_evidence(rng, 8000),
        position=Position(step=2, step_started_at=0.0, started_at=-900.0),
        policy=Policy(),
    )
    assert (last.action, last.to_step, last.final) == ("promote", 3, True)


def test_no_live_worker_or_errors_over_the_ceiling_roll_back_at_once() -> None:
    rng = np.random.default_rng(3)
    position = Position(step=0, step_started_at=0.0, started_at=0.0)
    dead = decide(
        now=61.0, canary=_evidence(rng, 0, live=0), stable=_evidence(rng, 100), position=position, policy=Policy()
    )
    assert (dead.action, dead.reason) == ("rollback", "canary has no live worker")
    starting = decide(
        now=30.0, canary=_evidence(rng, 0, live=0), stable=_evidence(rng, 100), position=position, policy=Policy()
    )
    assert starting.action == "continue"
    failing = decide(
        now=5.0, canary=_evidence(rng, 12, errors=0.6), stable=_evidence(rng, 100), position=position, policy=Policy()
    )
    assert failing.action == "rollback" and "hard ceiling" in failing.reason


def test_a_significant_difference_below_the_margin_does_not_roll_back() -> None:
    rng = np.random.default_rng(4)
    canary, stable = _evidence(rng, 20_000, latency=41.6), _evidence(rng, 20_000, latency=40.0)
    decision = decide(
        now=400.0,
        canary=canary,
        stable=stable,
        policy=Policy(),
        position=Position(step=2, step_started_at=0.0, started_at=0.0),
    )
    latency = next(t for t in decision.evidence["tests"] if t["test"] == "latency")
    assert latency["significant"] and not latency["breach"]
    assert latency["effect"] == pytest.approx(0.04, abs=0.01)
    assert decision.action == "promote"


def test_the_shadow_phase_gates_on_agreement() -> None:
    rng = np.random.default_rng(5)
    position = Position(step=SHADOW_STEP, step_started_at=0.0, started_at=0.0)
    stable = _evidence(rng, 5000)

    def shadow(agree: float) -> Evidence:
        base = _evidence(rng, 400)
        return Evidence(
            requests=base.requests,
            errors=base.errors,
            latency_ms=base.latency_ms,
            agreement=(rng.random(400) < agree).astype(float).tolist(),
        )

    good = decide(now=300.0, canary=shadow(0.98), stable=stable, position=position, policy=Policy())
    assert (good.action, good.to_step) == ("promote", 0)
    assert next(t for t in good.evidence["tests"] if t["test"] == "agreement")["meets_bar"]
    bad = decide(now=300.0, canary=shadow(0.6), stable=stable, position=position, policy=Policy())
    assert bad.action == "rollback" and "agreement" in bad.reason
    unsure = decide(now=300.0, canary=shadow(0.905), stable=stable, position=position, policy=Policy())
    assert unsure.action == "continue" and "not yet shown above 0.9" in unsure.reason


# --- whole rollouts in simulated time ----------------------------------------------------------------


def test_identical_versions_are_promoted_in_every_simulated_rollout() -> None:
    outcomes = [simulate(policy=FAST, stable=CLASSIFIER, canary=CLASSIFIER, seed=seed) for seed in range(20)]
    assert [o.outcome for o in outcomes] == ["promoted"] * 20
    assert all(o.step == len(FAST.steps) - 1 for o in outcomes)
    # Every look ran the full battery: errors, latency, top-p, low confidence, labels.
    tested = {t["test"] for o in outcomes for d in o.decisions for t in d.decision.evidence.get("tests", [])}
    assert tested == set(STEP_TESTS)


def test_simulation_is_deterministic_for_a_seed() -> None:
    first = simulate(policy=FAST, stable=CLASSIFIER, canary=CLASSIFIER, seed=11)
    again = simulate(policy=FAST, stable=CLASSIFIER, canary=CLASSIFIER, seed=11)
    assert first == again


def test_a_confidently_wrong_classifier_at_five_percent_rolls_back(record_property: pytest.RecordProperty) -> None:
    stable = VersionProfile(error_rate=0.0, labels=LABELS)
    wrong = VersionProfile(error_rate=0.0, labels={"billing": 0.25, "tech": 0.45, "account": 0.2, "other": 0.1})
    needed = []
    for seed in range(20):
        outcome = simulate(policy=Policy(), stable=stable, canary=wrong, seed=seed, start_step=1)
        assert (outcome.outcome, outcome.step) == ("rolled_back", 1), outcome.decisions[-1].decision.reason
        last = outcome.decisions[-1].decision
        assert last.reason == "guardrail breach: label_shift"
        assert {t["test"] for t in last.evidence["tests"] if t["breach"]} == {"label_shift"}
        needed.append(outcome.canary_samples)
    record_property("canary_samples_to_rollback", needed)
    assert max(needed) <= 500, needed


def test_an_error_spike_rolls_back() -> None:
    outcome = simulate(policy=FAST, stable=CLASSIFIER, seed=3, canary=VersionProfile(error_rate=0.08, labels=LABELS))
    assert outcome.outcome == "rolled_back"
    assert outcome.decisions[-1].decision.reason == "guardrail breach: error_rate"


def test_a_latency_regression_rolls_back() -> None:
    outcome = simulate(
        policy=FAST,
        stable=CLASSIFIER,
        seed=4,
        canary=VersionProfile(error_rate=0.01, labels=LABELS, latency_median_ms=60.0),
    )
    assert outcome.outcome == "rolled_back"
    assert outcome.decisions[-1].decision.reason == "guardrail breach: latency"


@pytest.mark.soak  # 200 simulated rollouts: a statistical run, not a unit check
def test_identical_versions_under_slow_traffic_roll_back_at_most_alpha(
    record_property: pytest.RecordProperty,
) -> None:
    """A/A over 200 seeds at 2 requests/s: the controller looks about 120 times a rollout, most of
    them while waiting for `min_samples`, and every fourth rollout starts with a shadow phase. A
    soak of one look interval is what a policy that relies on `min_samples` sets; a correction
    counting `soak_s / look_interval_s` looks per step rolled back 15 of these 200."""
    policy = Policy(steps=(10, 50, 100), soak_s=10, look_interval_s=10)
    outcomes = [
        simulate(
            policy=policy,
            stable=CLASSIFIER,
            canary=CLASSIFIER,
            seed=seed,
            rate_per_s=2.0,
            start_step=SHADOW_STEP if seed % 4 == 0 else 0,
        )
        for seed in range(200)
    ]
    assert {o.outcome for o in outcomes} <= {"promoted", "rolled_back"}
    waiting = [sum("canary samples" in d.decision.reason for d in o.decisions) for o in outcomes]
    assert np.mean(waiting) > 80, "not slow traffic: few looks before min_samples"
    rolled_back = [seed for seed, o in enumerate(outcomes) if o.outcome == "rolled_back"]
    record_property("false_rollbacks", rolled_back)
    assert len(rolled_back) / len(outcomes) <= policy.alpha, rolled_back
