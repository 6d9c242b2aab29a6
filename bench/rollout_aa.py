"""The rollout controller's error bound and power, in simulated time (docs/ARCHITECTURE.md,
"Rollouts").

A/A: canary and stable behave identically (a 4-label classifier, 1 % errors, lognormal latency),
and every rollback is a false one. The always-valid tests promise at most `alpha` (0.05) of
those over a whole rollout, however many looks it takes; the scenarios include slow traffic,
where the controller looks hundreds of times while it waits for `min_samples`, rollouts that
start with a shadow phase, and a policy with every margin at 0 (significance alone, the bound
without the margins' help). Each row reports the rate with its exact (Clopper-Pearson) 95 %
upper bound.

Degraded: a confidently wrong classifier (same errors, latency and top probability; labels
moved by a total-variation distance of 0.15, or 12 Zipf-weighted labels deranged as in
tests/faults/test_degraded_canary.py) at the 5 % step, and how many canary samples the rollback
took.

Every rollout runs `scheduler.rollout_sim.simulate`, which calls the controller's own
`guardrails.decide`. Seeds are 0 .. N-1 per scenario, so a run is reproducible.

Run: ``python -m bench.rollout_aa [--seeds 200] [--processes 2]`` (about 4 min on one core).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from scipy import stats as sps

from bench.machine import machine_info
from bench.output import command_line, table, write_json
from scheduler.guardrails import SHADOW_STEP
from scheduler.rollout_sim import SimulationResult, VersionProfile, simulate
from sluice.rollout_policy import Policy

LABELS = {"billing": 0.4, "tech": 0.3, "account": 0.2, "other": 0.1}
CLASSIFIER = VersionProfile(error_rate=0.01, labels=LABELS)
# The degraded scenarios: no errors on either side, so only the labels can tell them apart.
RIGHT = VersionProfile(error_rate=0.0, labels=LABELS)
WRONG = VersionProfile(error_rate=0.0, labels={"billing": 0.25, "tech": 0.45, "account": 0.2, "other": 0.1})
NO_MARGINS = Policy(
    error_margin=0.0, latency_margin=0.0, top_p_margin=0.0, low_confidence_margin=0.0, label_tvd_margin=0.0
)
SHORT_SOAK = Policy(steps=(10, 50, 100), soak_s=10, look_interval_s=10)


def _zipf_deranged(labels: int = 12, seed: int = 7) -> tuple[dict[str, float], dict[str, float]]:
    """Zipf-weighted traffic over `labels` intents, and the same with every answer moved to
    another label along one random cycle (workers.models.head.write_degraded_head)."""
    weights = 1 / np.arange(1, labels + 1)
    order = np.random.default_rng(seed).permutation(labels)
    moved = np.empty(labels, dtype=int)
    moved[order] = np.roll(order, -1)
    names = [f"intent{i}" for i in range(labels)]
    return dict(zip(names, weights.tolist(), strict=True)), dict(zip(names, weights[moved].tolist(), strict=True))


ZIPF, ZIPF_DERANGED = _zipf_deranged()


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    policy: Policy
    rate_per_s: float
    canary: VersionProfile = CLASSIFIER
    stable: VersionProfile = CLASSIFIER
    start_step: int = 0
    shadow_every: int = 0  # every n-th seed starts with a shadow phase (0: none)
    kind: str = "a/a"


SCENARIOS = (
    Scenario("default policy, 100 req/s", Policy(), 100.0),
    Scenario("default policy, 100 req/s, shadow phase first", Policy(), 100.0, start_step=SHADOW_STEP),
    Scenario("default policy, 5 req/s (slow)", Policy(), 5.0),
    Scenario("soak 10 s, steps 10/50/100, 2 req/s (slow), 1 in 4 shadow first", SHORT_SOAK, 2.0, shadow_every=4),
    Scenario("every margin 0 (significance alone), 5 req/s (slow)", NO_MARGINS, 5.0),
    Scenario(
        "labels moved by TVD 0.15 at 5 %, 100 req/s",
        Policy(),
        100.0,
        canary=WRONG,
        stable=RIGHT,
        start_step=1,
        kind="degraded",
    ),
    Scenario(
        "12 Zipf labels deranged at 5 %, 100 req/s",
        Policy(min_test_samples=30),
        100.0,
        canary=replace(RIGHT, labels=ZIPF_DERANGED),
        stable=replace(RIGHT, labels=ZIPF),
        start_step=1,
        kind="degraded",
    ),
)


@dataclass(frozen=True, slots=True)
class Run:
    outcome: str
    canary_samples: int
    looks: int
    looks_waiting: int  # looks that found too few canary samples to promote
    breached: tuple[str, ...]


def _one(scenario: Scenario, seed: int) -> Run:
    shadow = scenario.start_step == SHADOW_STEP or (scenario.shadow_every and seed % scenario.shadow_every == 0)
    result: SimulationResult = simulate(
        policy=scenario.policy,
        stable=scenario.stable,
        canary=scenario.canary,
        seed=seed,
        rate_per_s=scenario.rate_per_s,
        start_step=SHADOW_STEP if shadow else scenario.start_step,
    )
    last = result.decisions[-1].decision
    breached = tuple(t["test"] for t in last.evidence.get("tests", []) if t.get("breach"))
    waiting = sum("canary samples" in d.decision.reason for d in result.decisions)
    return Run(result.outcome, result.canary_samples, len(result.decisions), waiting, breached)


def _upper_95(failures: int, trials: int) -> float:
    """The exact one-sided 95 % upper confidence bound of a binomial rate (Clopper-Pearson)."""
    return 1.0 if failures >= trials else float(sps.beta.ppf(0.95, failures + 1, trials - failures))


def summarise(scenario: Scenario, runs: list[Run]) -> dict[str, Any]:
    outcomes = Counter(r.outcome for r in runs)
    rolled = [r for r in runs if r.outcome == "rolled_back"]
    summary: dict[str, Any] = {
        "scenario": scenario.name,
        "kind": scenario.kind,
        "seeds": len(runs),
        "outcomes": dict(outcomes),
        "alpha": scenario.policy.alpha,
        "policy": scenario.policy.to_dict(),
        "rate_per_s": scenario.rate_per_s,
        "median_looks": float(np.median([r.looks for r in runs])),
        "median_looks_waiting_for_samples": float(np.median([r.looks_waiting for r in runs])),
        "breaches": dict(Counter(t for r in rolled for t in r.breached)),
    }
    if scenario.kind == "a/a":
        summary["false_rollbacks"] = len(rolled)
        summary["false_rollback_rate"] = len(rolled) / len(runs)
        summary["false_rollback_rate_upper_95"] = _upper_95(len(rolled), len(runs))
    else:
        samples = np.array([r.canary_samples for r in rolled]) if rolled else np.zeros(1)
        summary["rolled_back"] = len(rolled)
        summary["canary_samples_to_rollback"] = {
            "median": float(np.median(samples)),
            "p10": float(np.percentile(samples, 10)),
            "p90": float(np.percentile(samples, 90)),
            "min": int(samples.min()),
            "max": int(samples.max()),
            "within_500": int(np.sum(samples <= 500)),
        }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.rollout_aa", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=200, help="rollouts per scenario (the issue asks >= 200)")
    parser.add_argument("--processes", type=int, default=1, help="simulations in parallel")
    parser.add_argument("--output", default="rollout_aa.json", help="file name under bench/results/")
    args = parser.parse_args()

    started = time.monotonic()
    summaries = []
    with ProcessPoolExecutor(max_workers=args.processes) as pool:
        for scenario in SCENARIOS:
            t0 = time.monotonic()
            runs = list(pool.map(_one, [scenario] * args.seeds, range(args.seeds), chunksize=8))
            summaries.append({**summarise(scenario, runs), "seconds": round(time.monotonic() - t0, 1)})
            print(
                f"{scenario.name}: {dict(Counter(r.outcome for r in runs))} ({time.monotonic() - t0:.0f} s)", flush=True
            )

    print("\nA/A: identical versions, every rollback is false")
    print(
        table(
            [
                "scenario",
                "seeds",
                "false rollbacks",
                "rate",
                "95 % upper",
                "alpha",
                "looks (median)",
                "looks waiting for samples (median)",
            ],
            [
                [
                    s["scenario"],
                    s["seeds"],
                    s["false_rollbacks"],
                    s["false_rollback_rate"],
                    s["false_rollback_rate_upper_95"],
                    s["alpha"],
                    s["median_looks"],
                    s["median_looks_waiting_for_samples"],
                ]
                for s in summaries
                if s["kind"] == "a/a"
            ],
        )
    )
    print("\nDegraded canary at the 5 % step: canary samples until the rollback")
    print(
        table(
            ["scenario", "seeds", "rolled back", "median", "p10", "p90", "max", "within 500"],
            [
                [
                    s["scenario"],
                    s["seeds"],
                    s["rolled_back"],
                    *(s["canary_samples_to_rollback"][k] for k in ("median", "p10", "p90", "max", "within_500")),
                ]
                for s in summaries
                if s["kind"] == "degraded"
            ],
        )
    )
    command = command_line("bench.rollout_aa")
    path = write_json(
        args.output,
        {
            "bench": "rollout_aa",
            "command": command,
            "machine": machine_info(),
            "seconds": round(time.monotonic() - started, 1),
            "scenarios": summaries,
        },
    )
    print(f"reproduce: {command}\nresults: bench/results/{path.name}")


if __name__ == "__main__":
    main()
