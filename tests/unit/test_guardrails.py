"""The guardrail decision: its statistics against known values, and whole rollouts in simulated
time (identical versions promote; a canary that is worse in one way rolls back)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import stats as sps

from scheduler.guardrails import (
    SHADOW_STEP,
    Evidence,
    Policy,
    Position,
    decide,
    label_shift,
    mean_bounds,
    rank_test_greater,
    total_variation,
    two_proportion_greater,
)
from scheduler.simulate import VersionProfile, simulate
from sluice.errors import InvalidPolicy

LABELS = {"billing": 0.4, "tech": 0.3, "account": 0.2, "other": 0.1}
CLASSIFIER = VersionProfile(error_rate=0.01, labels=LABELS)
# Fewer looks than the default keeps 20 simulated rollouts to a few seconds of CPU.
FAST = Policy(soak_s=300, look_interval_s=30)


# --- statistics against known values ---------------------------------------------------------------


def test_two_proportion_z_test_matches_the_textbook_value() -> None:
    # 30/200 vs 20/200: pooled p = 0.125, se = sqrt(0.125 * 0.875 * 2/200) = 0.0330719.
    result = two_proportion_greater(30, 200, 20, 200)
    assert result.method == "z"
    assert result.statistic == pytest.approx(0.05 / 0.0330719, abs=1e-5)
    assert result.statistic == pytest.approx(1.511858, abs=1e-6)
    assert result.p_value == pytest.approx(0.065285, abs=1e-6)
    assert two_proportion_greater(20, 200, 30, 200).p_value == pytest.approx(1 - 0.065285, abs=1e-6)


def test_rare_events_use_fishers_exact_test() -> None:
    # The lady tasting tea: P(X >= 3) for the hypergeometric (8, 4, 4) is 17/70.
    result = two_proportion_greater(3, 4, 1, 4)
    assert result.method == "fisher-exact"
    assert result.p_value == pytest.approx(17 / 70, abs=1e-9)
    assert two_proportion_greater(0, 500, 0, 5000).p_value == 1.0


def test_mann_whitney_by_hand_and_with_ties() -> None:
    # x = 3, 4, 5 above y = 1, 2: ranks 3+4+5, U = 12 - 6 = 6 = n1*n2; var = 3*2*6/12 = 3.
    result, superiority = rank_test_greater([3, 4, 5], [1, 2])
    assert superiority == 1.0
    assert result.statistic == pytest.approx(2.5 / math.sqrt(3), abs=1e-9)
    assert result.p_value == pytest.approx(0.074457, abs=1e-6)
    rng = np.random.default_rng(7)
    x, y = rng.integers(0, 6, 70).astype(float), rng.integers(0, 5, 90).astype(float)  # many ties
    ours, _ = rank_test_greater(x.tolist(), y.tolist())
    reference = sps.mannwhitneyu(x, y, alternative="greater", method="asymptotic", use_continuity=True)
    assert ours.p_value == pytest.approx(float(reference.pvalue), rel=1e-9)
    assert rank_test_greater([1.0] * 60, [1.0] * 60)[0].p_value == 1.0


def test_chi_square_and_total_variation_by_hand() -> None:
    # Every expected count is 25: chi2 = 4 * 5**2 / 25 = 4 on 1 df, p = 0.0455.
    result, df = label_shift({"a": 20, "b": 30}, {"a": 30, "b": 20})
    assert (result.statistic, df) == (4.0, 1)
    assert result.p_value == pytest.approx(0.0455003, abs=1e-6)
    ours, df = label_shift({"a": 10, "b": 20, "c": 30}, {"a": 6, "b": 9, "c": 17})
    chi2, p, dof, _ = sps.chi2_contingency([[10, 20, 30], [6, 9, 17]], correction=False)
    assert (ours.statistic, ours.p_value, df) == (pytest.approx(chi2), pytest.approx(p), dof)
    assert total_variation({"a": 5, "b": 5}, {"a": 8, "b": 2}) == pytest.approx(0.3)
    assert total_variation({"a": 1}, {"b": 1}) == pytest.approx(1.0)


def test_rare_labels_are_pooled_before_the_chi_square() -> None:
    # "c" and "d" are each expected 3 times in the small row: pooled into one cell (df 2, not 3).
    _, df = label_shift({"a": 50, "b": 48, "c": 3, "d": 3}, {"a": 500, "b": 480, "c": 30, "d": 30})
    assert df == 2
    # A pool that is still rare merges into the smallest kept label.
    _, df = label_shift({"a": 50, "b": 49, "c": 1}, {"a": 500, "b": 490, "c": 10})
    assert df == 1


def test_confidence_bounds_of_a_mean() -> None:
    # Wilson's 90 % two-sided interval for 90/100 is (0.8396, 0.9393).
    mean, lower, upper, method = mean_bounds([1.0] * 90 + [0.0] * 10, 0.05)
    assert (method, mean) == ("wilson", 0.9)
    assert (lower, upper) == (pytest.approx(0.839644, abs=1e-6), pytest.approx(0.939281, abs=1e-6))
    # Student's t, 3 df: 0.91 - 2.353363 * 0.0820569 / 2.
    mean, lower, _, method = mean_bounds([0.9, 0.95, 0.99, 0.8], 0.05)
    assert method == "t"
    assert lower == pytest.approx(0.91 - 2.353363 * 0.0820569 / 2, abs=1e-5)


# --- the policy -----------------------------------------------------------------------------------


def test_policy_validates_and_round_trips() -> None:
    policy = Policy(steps=(2, 10, 100), soak_s=60, min_samples=100)
    assert Policy.from_dict(json.loads(json.dumps(policy.to_dict()))) == policy
    for bad in ({"steps": (5, 1, 100)}, {"steps": (1, 50)}, {"steps": (100,)}, {"alpha": 0},
                {"min_samples": 10}):
        with pytest.raises(InvalidPolicy):
            Policy(**bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidPolicy, match="unknown"):
        Policy.from_dict({"soak": 1})


# --- single decisions -----------------------------------------------------------------------------


def _evidence(rng: np.random.Generator, n: int, *, errors: float = 0.01, latency: float = 40.0,
              live: int = 1) -> Evidence:
    failed = int(round(n * errors))
    return Evidence(requests=n, errors=failed, latency_ms=rng.lognormal(math.log(latency), 0.3, n - failed).tolist(),
                    live_workers=live)


def test_not_enough_samples_continues() -> None:
    rng = np.random.default_rng(1)
    policy = Policy()
    decision = decide(now=1000.0, canary=_evidence(rng, 120), stable=_evidence(rng, 9000),
                      position=Position(step=0, step_started_at=0.0, started_at=0.0), policy=policy)
    assert decision.action == "continue"
    assert "canary samples 120/200" in decision.reason
    json.dumps(decision.evidence, allow_nan=False)
    # Below min_test_samples nothing is even tested, however bad it looks.
    decision = decide(now=10.0, canary=_evidence(rng, 30, latency=400.0), stable=_evidence(rng, 9000),
                      position=Position(step=0, step_started_at=0.0, started_at=0.0), policy=policy)
    assert decision.action == "continue" and decision.evidence["tests"] == []


def test_soak_time_is_required_as_well_as_samples() -> None:
    rng = np.random.default_rng(2)
    position = Position(step=1, step_started_at=0.0, started_at=-500.0)
    early = decide(now=100.0, canary=_evidence(rng, 400), stable=_evidence(rng, 8000), position=position,
                   policy=Policy())
    assert early.action == "continue" and "soaking 100/300 s" in early.reason
    later = decide(now=300.0, canary=_evidence(rng, 400), stable=_evidence(rng, 8000), position=position,
                   policy=Policy())
    assert (later.action, later.to_step, later.final) == ("promote", 2, False)
    last = decide(now=300.0, canary=_evidence(rng, 400), stable=_evidence(rng, 8000),
                  position=Position(step=2, step_started_at=0.0, started_at=-900.0), policy=Policy())
    assert (last.action, last.to_step, last.final) == ("promote", 3, True)


def test_no_live_worker_or_errors_over_the_ceiling_roll_back_at_once() -> None:
    rng = np.random.default_rng(3)
    position = Position(step=0, step_started_at=0.0, started_at=0.0)
    dead = decide(now=61.0, canary=_evidence(rng, 0, live=0), stable=_evidence(rng, 100), position=position,
                  policy=Policy())
    assert (dead.action, dead.reason) == ("rollback", "canary has no live worker")
    starting = decide(now=30.0, canary=_evidence(rng, 0, live=0), stable=_evidence(rng, 100), position=position,
                      policy=Policy())
    assert starting.action == "continue"
    failing = decide(now=5.0, canary=_evidence(rng, 12, errors=0.6), stable=_evidence(rng, 100),
                     position=position, policy=Policy())
    assert failing.action == "rollback" and "hard ceiling" in failing.reason


def test_a_significant_difference_below_the_margin_does_not_roll_back() -> None:
    rng = np.random.default_rng(4)
    canary, stable = _evidence(rng, 20_000, latency=41.6), _evidence(rng, 20_000, latency=40.0)
    decision = decide(now=400.0, canary=canary, stable=stable, policy=Policy(),
                      position=Position(step=2, step_started_at=0.0, started_at=0.0))
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
        return Evidence(requests=base.requests, errors=base.errors, latency_ms=base.latency_ms,
                        agreement=(rng.random(400) < agree).astype(float).tolist())

    good = decide(now=300.0, canary=shadow(0.98), stable=stable, position=position, policy=Policy())
    assert (good.action, good.to_step) == ("promote", 0)
    assert next(t for t in good.evidence["tests"] if t["test"] == "agreement")["meets_bar"]
    bad = decide(now=300.0, canary=shadow(0.6), stable=stable, position=position, policy=Policy())
    assert bad.action == "rollback" and "agreement" in bad.reason
    unsure = decide(now=300.0, canary=shadow(0.905), stable=stable, position=position, policy=Policy())
    assert unsure.action == "continue" and "agreement lower bound" in unsure.reason


# --- whole rollouts in simulated time ----------------------------------------------------------------


def test_identical_versions_are_promoted_in_every_simulated_rollout() -> None:
    outcomes = [simulate(policy=FAST, stable=CLASSIFIER, canary=CLASSIFIER, seed=seed) for seed in range(20)]
    assert [o.outcome for o in outcomes] == ["promoted"] * 20
    assert all(o.step == len(FAST.steps) - 1 for o in outcomes)
    # Every look ran the full battery: errors, latency, top-p, low confidence, labels.
    tested = {t["test"] for o in outcomes for d in o.decisions for t in d.decision.evidence.get("tests", [])}
    assert tested == {"error_rate", "latency", "top_p", "low_confidence", "label_shift"}


def test_simulation_is_deterministic_for_a_seed() -> None:
    first = simulate(policy=FAST, stable=CLASSIFIER, canary=CLASSIFIER, seed=11)
    again = simulate(policy=FAST, stable=CLASSIFIER, canary=CLASSIFIER, seed=11)
    assert first == again


def test_a_confidently_wrong_classifier_at_five_percent_rolls_back(record_property: pytest.RecordProperty) -> None:
    stable = VersionProfile(error_rate=0.0, labels=LABELS)
    wrong = VersionProfile(error_rate=0.0, labels={"billing": 0.25, "tech": 0.45, "account": 0.2, "other": 0.1})
    needed = []
    for seed in range(5):
        outcome = simulate(policy=Policy(), stable=stable, canary=wrong, seed=seed, start_step=1)
        assert (outcome.outcome, outcome.step) == ("rolled_back", 1), outcome.decisions[-1].decision.reason
        last = outcome.decisions[-1].decision
        assert last.reason == "guardrail breach: label_shift"
        assert {t["test"] for t in last.evidence["tests"] if t["breach"]} == {"label_shift"}
        needed.append(outcome.canary_samples)
    record_property("canary_samples_to_rollback", needed)
    assert max(needed) < 600, needed


def test_an_error_spike_rolls_back() -> None:
    outcome = simulate(policy=FAST, stable=CLASSIFIER, seed=3,
                       canary=VersionProfile(error_rate=0.08, labels=LABELS))
    assert outcome.outcome == "rolled_back"
    assert outcome.decisions[-1].decision.reason == "guardrail breach: error_rate"


def test_a_latency_regression_rolls_back() -> None:
    outcome = simulate(policy=FAST, stable=CLASSIFIER, seed=4,
                       canary=VersionProfile(error_rate=0.01, labels=LABELS, latency_median_ms=60.0))
    assert outcome.outcome == "rolled_back"
    assert outcome.decisions[-1].decision.reason == "guardrail breach: latency"
