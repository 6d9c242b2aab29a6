"""`sluice bench frontier` end to end on the synthetic kind (the real Worker on real Redis, a 2 x 2
grid of short phases), then `sluice plan` on the frontier it wrote."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import redis
from typer.testing import CliRunner

from launch.cli import app
from launch.embedded import answers_ping
from launch.private_valkey import private_valkey

# A benchmark run end to end: with the soak runs, out of a plain `pytest`.
pytestmark = [pytest.mark.slow, pytest.mark.soak]

COST = {"fixed_s": 0.004, "per_item_s": 0.002, "per_token_s": 0.00005}
MODEL = "synthetic:?" + "&".join(f"{name}={value}" for name, value in COST.items())
BUDGET_MS = 1000.0


@pytest.fixture(scope="module")
def swept(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("frontier")
    result = CliRunner().invoke(app, [
        "bench", "frontier", "--model", MODEL, "--batch-sizes", "1,8", "--waits-ms", "2,10", "--fractions", "0.5,0.9",
        "--phase-s", "1", "--p99-budget-ms", str(BUDGET_MS), "--texts", "256", "--redis-url", redis_url,
        "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out, result.output


def test_the_sweep_writes_its_table_plot_and_data_for_both_series(swept: tuple[Path, str]) -> None:
    out, printed = swept
    document = json.loads((out / "frontier.json").read_text())
    for name in ("real", "sim"):
        configs = document["series"][name]["configs"]
        assert [(c["max_batch_size"], c["max_wait_ms"]) for c in configs] == [(1, 2), (1, 10), (8, 2), (8, 10)]
        assert all(c["capacity_rps"] > 0 and c["rungs"] for c in configs)
        best = document["series"][name]["best"]
        assert best is not None and best["p99_ms"] <= BUDGET_MS
        # The best is the most throughput any rung kept up with within the budget.
        within = [r["throughput_rps"] for c in configs for r in c["rungs"] if r["kept_up"] and r["p99_ms"] <= BUDGET_MS]
        assert best["throughput_rps"] == max(within)
    # The simulator runs at the cost the real passes were measured at: the declared one, plus
    # whatever time.sleep overshoots by (a fixed cost per pass).
    fit = document["cost_fit"]
    assert fit["per_token_s"] == pytest.approx(COST["per_token_s"], rel=0.2)
    assert COST["fixed_s"] <= fit["fixed_s"] + fit["per_item_s"] <= COST["fixed_s"] + COST["per_item_s"] + 0.005

    table = (out / "frontier.md").read_text().splitlines()
    rows = [line for line in table if line.startswith("| ") and line[2].isdigit()]
    marks = [row.rsplit("|", 2)[1].strip().split(", ") for row in rows]
    assert len(rows) == 4 and sum(1 for mark in marks if "best" in mark) == 1
    assert (out / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "batching frontier" in printed and str(out / "frontier.png") in printed.replace("\n", "")


def test_the_sweep_leaves_no_key_behind(swept: tuple[Path, str], rds: redis.Redis) -> None:
    assert not list(rds.scan_iter(match="sluice:*frontier-*"))


def test_plan_from_the_frontier(swept: tuple[Path, str]) -> None:
    out, _ = swept
    best = json.loads((out / "frontier.json").read_text())["series"]["real"]["best"]
    result = CliRunner().invoke(app, [
        "plan", "--frontier", str(out / "frontier.json"), "--p99-budget-ms", str(BUDGET_MS), "--peak-rps", "500",
        "--headroom", "0.25", "--device", "cpu=0.10", "--device", "fast=1.5:x3", "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["device"]: row for row in json.loads(result.output)["devices"]}
    assert rows["cpu"]["per_replica_rps"] == best["throughput_rps"]
    assert rows["cpu"]["replicas"] == math.ceil(500 * 1.25 / best["throughput_rps"])
    assert rows["cpu"]["cost_per_million_at_peak"] == pytest.approx(
        rows["cpu"]["replicas"] * 0.10 / (500 * 3600) * 1e6)
    # Three times as fast: at least three times the throughput within the same budget.
    assert rows["fast"]["per_replica_rps"] >= 3 * best["throughput_rps"]
    assert rows["fast"]["replicas"] <= rows["cpu"]["replicas"]
    table = CliRunner().invoke(app, [
        "plan", "--frontier", str(out / "frontier.json"), "--p99-budget-ms", str(BUDGET_MS), "--peak-rps", "500",
        "--device", "cpu=0.10"])
    assert table.exit_code == 0 and "per 1M at peak" in table.output


def test_a_run_without_a_redis_url_gets_a_valkey_of_its_own_that_is_gone_afterwards() -> None:
    with private_valkey() as url:
        client = redis.Redis.from_url(url)
        assert client.ping()
        assert client.dbsize() == 0
        port = client.connection_pool.connection_kwargs["port"]
        client.close()
    assert not answers_ping(port)
