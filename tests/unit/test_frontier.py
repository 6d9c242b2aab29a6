"""The frontier's pure logic: the keep-up rule, the Pareto front and the budget pick, the sweep's
ladder, the cost fit, the one-replica simulator, and `sluice plan`'s arithmetic and device syntax."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from launch.cli import app
from scheduler.planning.capacity_plan import DeviceSpec, parse_device, plan_device
from scheduler.planning.capacity_sim import CostModel
from scheduler.planning.frontier import (
    ConfigRun,
    Point,
    Rung,
    Series,
    backlog_growth,
    best_under_budget,
    drain_rate,
    fit_cost,
    load_series,
    measure_rung,
    pareto_front,
    poisson_arrivals,
    sweep,
)
from scheduler.planning.frontier_sim import SimJob, run_replica


def rung(offered: float, p99: float | None, *, kept_up: bool = True, throughput: float | None = None) -> Rung:
    return Rung(offered_rps=offered, jobs=100, throughput_rps=offered if throughput is None else throughput,
                p50_ms=p99, p95_ms=p99, p99_ms=p99, mean_batch=1.0, growth_rps=0.0, kept_up=kept_up)


# --- front and budget -------------------------------------------------------------------------------


def test_the_front_keeps_the_points_no_other_beats_on_both_throughput_and_p99() -> None:
    a, b, c = Point(1, 2, 100, 50), Point(4, 2, 200, 80), Point(8, 5, 300, 400)
    beaten = [Point(1, 5, 90, 60), Point(4, 5, 200, 90), Point(8, 2, 250, 500)]
    assert pareto_front([c, *beaten, a, b]) == [a, b, c]


def test_the_budget_pick_is_the_most_throughput_within_the_budget_and_the_lower_p99_on_a_tie() -> None:
    points = [Point(1, 2, 100, 50), Point(4, 2, 200, 180), Point(4, 5, 200, 150), Point(8, 5, 300, 400)]
    assert best_under_budget(points, 200) == Point(4, 5, 200, 150)
    assert best_under_budget(points, 400) == Point(8, 5, 300, 400)
    assert best_under_budget(points, 49) is None


def test_operating_points_are_the_rungs_kept_up_with_and_sustained_is_the_highest() -> None:
    config = ConfigRun(8, 5.0, 120.0, (rung(60, 40), rung(90, 120), rung(110, 900, kept_up=False)))
    assert config.sustained == rung(90, 120)
    assert [p.throughput_rps for p in config.points()] == [60, 90]
    # Near capacity the p99 climbs: within 100 ms the best is a lower rung, not the sustained one.
    assert config.at_budget(100) == Point(8, 5.0, 60, 40)
    assert ConfigRun(1, 2.0, 10.0, (rung(6, 50, kept_up=False),)).sustained is None


def test_a_series_survives_its_json_and_load_series_names_what_is_missing() -> None:
    series = Series("real", (ConfigRun(4, 2.0, 80.0, (rung(40, 30), rung(60, 70, kept_up=False))),))
    document = json.loads(json.dumps({"series": {"real": series.to_dict(50.0)}}))
    assert load_series(document, "real") == series
    assert document["series"]["real"]["best"] == {"max_batch_size": 4, "max_wait_ms": 2.0, "throughput_rps": 40,
                                                  "p99_ms": 30}
    with pytest.raises(ValueError, match="no 'sim' series"):
        load_series(document, "sim")


# --- measuring a rung ---------------------------------------------------------------------------------


def test_a_replica_that_keeps_up_shows_no_backlog_growth_even_when_it_finishes_in_batches() -> None:
    arrivals = [i / 100 for i in range(400)]  # 100/s for 4 s
    # Finished in batches of 25, each 0.3 s after its last arrival: late and lumpy, not behind.
    finishes = [arrivals[(i // 25) * 25 + 24] + 0.3 for i in range(400)]
    assert abs(backlog_growth(arrivals, finishes, 4.0)) < 5
    measured = measure_rung(offered_rps=100, duration_s=4.0, arrivals=arrivals, finishes=finishes,
                            latencies_ms=[(f - a) * 1000 for a, f in zip(arrivals, finishes, strict=True)],
                            batch_sizes=[25] * 16)
    assert measured.kept_up and measured.throughput_rps == 100 and measured.mean_batch == 25


def test_a_replica_serving_80_of_100_per_second_falls_behind_by_20_per_second() -> None:
    arrivals = [i / 100 for i in range(400)]
    finishes = [(i + 1) / 80 for i in range(400)]  # last one at 5 s
    assert backlog_growth(arrivals, finishes, 4.0) == pytest.approx(20, abs=1)
    measured = measure_rung(offered_rps=100, duration_s=4.0, arrivals=arrivals, finishes=finishes,
                            latencies_ms=[1.0] * 400, batch_sizes=[1] * 400)
    # What it served within the phase, not what was offered.
    assert not measured.kept_up and measured.throughput_rps == 80


def test_a_rung_with_jobs_left_unfinished_did_not_keep_up() -> None:
    arrivals = [i / 10 for i in range(20)]
    measured = measure_rung(offered_rps=10, duration_s=2.0, arrivals=arrivals, finishes=arrivals[:-1],
                            latencies_ms=[0.0] * 19, batch_sizes=[1] * 19)
    assert not measured.kept_up and measured.p99_ms == 0.0


def test_the_drain_rate_counts_from_the_first_batch_out() -> None:
    # 8 jobs done at 1.0 s (start-up included), then 4 every 0.5 s until 2.0 s: 8 jobs in 1 s.
    assert drain_rate([1.0] * 8 + [1.5] * 4 + [2.0] * 4) == 8.0
    with pytest.raises(ValueError):
        drain_rate([1.0, 1.0])


def test_poisson_arrivals_are_the_same_pattern_at_any_rate() -> None:
    slow, fast = poisson_arrivals(50, 40, seed=3), poisson_arrivals(100, 20, seed=3)
    assert [2 * t for t in fast] == pytest.approx(slow)
    assert 1800 < len(slow) < 2200 and slow == sorted(slow) and slow[-1] < 40
    assert poisson_arrivals(50, 40, seed=4) != slow


# --- the sweep ---------------------------------------------------------------------------------------


def test_the_sweep_probes_each_batch_size_once_and_climbs_until_a_rung_is_not_kept_up() -> None:
    probed: list[int] = []
    offered: list[tuple[int, float, float]] = []

    def probe(size: int) -> float:
        probed.append(size)
        return 100.0 * size

    def run(size: int, wait: float, rate: float, seed: int) -> Rung:
        offered.append((size, wait, rate))
        return rung(rate, 10.0, kept_up=rate < 85 * size)

    series = sweep("real", batch_sizes=(1, 4), waits_ms=(2.0, 10.0), fractions=(0.9, 0.5, 0.8), seed=0,
                   probe=probe, rung=run)
    assert probed == [1, 4]
    # Lowest fraction first; 0.9 of capacity is not kept up, and it is where each ladder stops.
    assert offered[:3] == [(1, 2.0, 50.0), (1, 2.0, 80.0), (1, 2.0, 90.0)]
    assert len(offered) == 12
    assert [(c.max_batch_size, c.max_wait_ms, c.sustained.offered_rps if c.sustained else None)
            for c in series.configs] == [(1, 2.0, 80.0), (1, 10.0, 80.0), (4, 2.0, 320.0), (4, 10.0, 320.0)]


def test_the_cost_fit_recovers_a_declared_cost() -> None:
    truth = CostModel(fixed_s=0.004, per_item_s=0.001, per_token_s=0.00003)
    passes = [(n, tokens, truth.batch_s(n, tokens)) for n in (1, 2, 5, 8, 16, 32) for tokens in (12, 30, 120, 250)]
    fit = fit_cost(passes)
    assert (fit.cost.fixed_s, fit.cost.per_item_s, fit.cost.per_token_s) == pytest.approx((0.004, 0.001, 0.00003))
    assert fit.r2 == pytest.approx(1.0) and fit.median_abs_error < 1e-9
    # No coefficient below zero, whatever the noise says.
    assert min(fit_cost([(1, 10, 0.01), (2, 10, 0.005), (4, 10, 0.002)]).to_dict()[k]
               for k in ("fixed_s", "per_item_s", "per_token_s")) >= 0


# --- the one-replica simulator -----------------------------------------------------------------------


def test_a_batch_closes_by_size_and_the_next_by_age_once_the_model_is_free() -> None:
    jobs = [SimJob(at=0.0, cost=10, tokens=10), SimJob(at=0.001, cost=10, tokens=10),
            SimJob(at=0.002, cost=10, tokens=10)]
    outcome = run_replica(jobs, max_batch_size=2, max_wait_ms=10.0, cost=CostModel(0.1, 0.0, 0.0))
    # Two close by size at 1 ms and run until 101 ms; the third is overdue by then and runs alone.
    assert outcome.finished == pytest.approx([0.101, 0.101, 0.201])
    assert outcome.batch_sizes == [2, 1]


def test_an_idle_replica_waits_out_max_wait_and_charges_the_longest_job_for_every_job() -> None:
    # Costs 95 and 100 share a length bucket; the model pads both to the longer one's 100 tokens.
    jobs = [SimJob(at=0.0, cost=95, tokens=10), SimJob(at=0.004, cost=100, tokens=100)]
    outcome = run_replica(jobs, max_batch_size=8, max_wait_ms=5.0, cost=CostModel(0.01, 0.001, 0.0001))
    assert outcome.finished == pytest.approx([0.005 + 0.01 + 2 * (0.001 + 0.0001 * 100)] * 2)


def test_a_handler_that_plans_passes_runs_them_in_turn_the_oldest_job_first() -> None:
    jobs = [SimJob(at=i * 0.001, cost=t, tokens=t) for i, t in enumerate((200, 220, 10, 12))]

    def by_length(lengths: Sequence[int]) -> list[list[int]]:
        return [[p for p, n in enumerate(lengths) if n < 100], [p for p, n in enumerate(lengths) if n >= 100]]

    outcome = run_replica(jobs, max_batch_size=4, max_wait_ms=0.0, cost=CostModel(0.0, 0.0, 0.001),
                          passes=by_length)
    # Job 0 runs alone at once (0.2 s); the other three then form one batch (one bucket) of two
    # passes, and the long one goes first: it holds job 1, the oldest.
    assert outcome.finished == pytest.approx([0.2, 0.42, 0.444, 0.444])
    assert outcome.batch_sizes == [1, 1, 2]


def test_the_replica_reads_no_more_than_its_prefetch() -> None:
    jobs = [SimJob(at=0.0, cost=c, tokens=c) for c in (200, 10, 200, 10)]
    cost = CostModel(0.0, 0.0, 0.001)
    # All four read at once: the two long jobs share a batch, then the two short ones.
    assert run_replica(jobs, max_batch_size=2, max_wait_ms=0.0, cost=cost).finished == pytest.approx(
        [0.4, 0.42, 0.4, 0.42])
    # Two held at most: the long one runs alone while the short one is held, and so on, in turn.
    assert run_replica(jobs, max_batch_size=2, max_wait_ms=0.0, cost=cost, prefetch_batches=1).finished == (
        pytest.approx([0.2, 0.21, 0.41, 0.42]))


# --- the plan -----------------------------------------------------------------------------------------


def test_device_syntax() -> None:
    assert parse_device("cpu=0.10") == DeviceSpec("cpu", 0.10)
    assert parse_device("h100=4.00:x2.5") == DeviceSpec("h100", 4.0, speedup=2.5)
    assert parse_device("a10=1.2:6") == DeviceSpec("a10", 1.2, speedup=6.0)
    assert parse_device("h100=4:runs/h100/frontier.json") == DeviceSpec("h100", 4.0, frontier=Path(
        "runs/h100/frontier.json"))
    for bad in ("cpu", "=1", "cpu=cheap", "cpu=-1", "cpu=1:x0", "cpu=1:-2", "cpu=nan"):
        with pytest.raises(ValueError):
            parse_device(bad)


SERIES = Series("real", (ConfigRun(8, 5.0, 200.0, (rung(100, 150), rung(150, 250))),))


def test_the_plan_of_a_device_by_hand() -> None:
    row = plan_device(SERIES, DeviceSpec("cpu", 0.10), p99_budget_ms=200, peak_rps=500, headroom=0.3)
    assert row.point == Point(8, 5.0, 100, 150)
    assert row.replicas == 7  # 500 x 1.3 / 100 = 6.5
    assert row.cost_per_hour == pytest.approx(0.70)
    assert row.cost_per_million_at_peak == pytest.approx(0.70 / (500 * 3600) * 1e6)  # 0.389
    assert row.cost_per_million_at_full == pytest.approx(0.10 / (100 * 3600) * 1e6)  # 0.278


def test_a_speed_factor_scales_the_frontier_before_the_budget_pick() -> None:
    row = plan_device(SERIES, DeviceSpec("h100", 4.0, speedup=2.0), p99_budget_ms=200, peak_rps=500, headroom=0.3)
    # Twice as fast: (200/s, 75 ms) and (300/s, 125 ms); both within 200 ms now.
    assert row.point == Point(8, 5.0, 300, 125)
    assert row.replicas == 3 and row.cost_per_hour == 12.0
    assert row.cost_per_million_at_full == pytest.approx(4.0 / (300 * 3600) * 1e6)


def test_the_plan_rounds_up_but_not_past_an_exact_fit_and_says_when_nothing_fits() -> None:
    exact = Series("real", (ConfigRun(1, 2.0, 20.0, (rung(10, 5),)),))
    assert plan_device(exact, DeviceSpec("cpu", 1.0), p99_budget_ms=10, peak_rps=100, headroom=0.1).replicas == 11
    none = plan_device(SERIES, DeviceSpec("cpu", 1.0), p99_budget_ms=100, peak_rps=500, headroom=0.3)
    assert none.point is None and none.replicas is None


def test_sluice_plan_prints_json_and_refuses_a_bad_device(tmp_path: Path) -> None:
    path = tmp_path / "frontier.json"
    path.write_text(json.dumps({"series": {"real": SERIES.to_dict(200.0)}}))
    runner = CliRunner()
    result = runner.invoke(app, ["plan", "--frontier", str(path), "--p99-budget-ms", "200", "--peak-rps",
                                          "500", "--device", "cpu=0.10", "--device", "gpu=4:x2", "--json"])
    assert result.exit_code == 0, result.output
    devices = {row["device"]: row for row in json.loads(result.output)["devices"]}
    assert devices["cpu"]["replicas"] == 7 and devices["gpu"]["replicas"] == 3
    assert devices["gpu"]["per_replica_rps"] == 300
    refused = runner.invoke(app, ["plan", "--frontier", str(path), "--p99-budget-ms", "200", "--peak-rps",
                                           "500", "--device", "cpu"])
    assert refused.exit_code == 2 and "NAME=PRICE" in refused.output


def test_sluice_plan_reads_the_measured_cost_of_a_version_from_its_stats() -> None:
    from launch.bench_cli import measured_figures, measured_line

    stats: dict[str, Any] = {"model": "minilm", "version": "v1", "window_s": 3600.0, "count": 4000,
                             "cost": {"padding_ratio": 1.18, "idle_slot_s": 12.0, "core_s": 200.0, "gpu_s": 0.0,
                                      "per_1k_jobs": 0.0025}}
    figures = measured_figures(stats)
    assert figures["core_s_per_job"] == 0.05 and figures["cost_per_million_jobs"] == pytest.approx(2.5)
    line = measured_line(figures)
    assert "padding 1.18x" in line and "0.05 core-s" in line and "per 1M jobs 2.500" in line
    unknown = measured_line(measured_figures({**stats, "count": 0, "cost": {**stats["cost"], "per_1k_jobs": None}}))
    assert "per 1M jobs —" in unknown and "— core-s" in unknown
