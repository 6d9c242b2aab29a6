"""The autoscaling simulator: the real batcher and the real policy on arrival traces, against an
HPA-like utilization policy with the same bounds and cold start."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scheduler.planning.capacity_sim import SimResult, simulate, traces

TRACES = traces(40.0)


@pytest.fixture(scope="module")
def spike() -> dict[str, SimResult]:
    return {policy: simulate(TRACES["spike"], policy) for policy in ("lag", "utilization")}


def test_on_a_spike_the_lag_policy_halves_the_p99_for_no_more_replica_minutes(spike: dict[str, SimResult]) -> None:
    lag, utilization = spike["lag"], spike["utilization"]
    assert lag.jobs == utilization.jobs > 100_000  # the same arrivals, every job served
    assert lag.p99_ms <= 0.5 * utilization.p99_ms, (lag.line(), utilization.line())
    assert lag.replica_minutes <= 1.1 * utilization.replica_minutes, (lag.line(), utilization.line())
    # It scaled up for the spike and back down after it.
    assert lag.max_replicas >= 4 and lag.timeline[-1][2] == 1


def test_a_periodic_load_changes_scale_a_bounded_number_of_times() -> None:
    result = simulate(TRACES["periodic"], "lag")
    # Ten bursts in 30 minutes: up for the first, held through the rest, down once after them.
    assert result.scale_changes <= 6, result.line()


def test_the_same_seed_gives_the_same_run() -> None:
    short = TRACES["steady"]
    assert simulate(short, "lag").line() == simulate(short, "lag").line()


def test_sluice_simulate_capacity_prints_one_json_line_per_policy_and_writes_the_plot(tmp_path: Path) -> None:
    png = tmp_path / "spike.png"
    done = subprocess.run(
        [sys.executable, "-m", "launch.cli", "simulate-capacity", "--trace", "spike", "--compare", "utilization",
         "--json", "--png", str(png)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["policy"] for line in lines] == ["lag", "utilization"]
    for line in lines:
        assert {"p50_ms", "p95_ms", "p99_ms", "replica_minutes", "scale_changes"} <= line.keys()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    refused = subprocess.run([sys.executable, "-m", "launch.cli", "simulate-capacity", "--trace", "tsunami"],
                             capture_output=True, text=True, timeout=60, check=False)
    assert refused.returncode == 2 and "tsunami" not in refused.stdout
