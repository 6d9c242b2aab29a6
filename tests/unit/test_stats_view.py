"""`sluice stats MODEL`: each version in a column of its own, the stable one first, retired ones left out."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from launch.stats_view import shown_versions, stats_table


def _body(count: int, p50: float, errors: int = 0) -> dict[str, Any]:
    cut = {"p50": p50, "p95": p50 * 2, "p99": p50 * 3 if count >= 300 else None}
    return {"window_s": 300.0, "count": count, "errors": errors, "error_rate": errors / count,
            "throughput_per_s": count / 300, "queue_wait_ms": cut, "model_ms": cut, "total_ms": cut,
            "batch_size": {"mean": 4.0, "histogram": {"4": count // 4}},
            "close_reasons": {"size": 3, "age": 1, "drain": 0}, "p99_min_samples": 300, "fill_ms": cut,
            "cost": {"padding_ratio": 1.25 if count >= 300 else None, "idle_slot_s": 2.0, "core_s": 12.5,
                     "gpu_s": 0.0, "per_1k_jobs": 0.0125 if count >= 300 else None}}


RESOURCE = {
    "name": "minilm", "routing": {"v1": 90.0, "v2": 10.0},
    "versions": [
        {"version": "v2", "state": "canary", "replicas": {"live": 1, "desired": 2}},
        {"version": "v0", "state": "retired"},
        {"version": "v1", "state": "stable", "replicas": {"live": 3, "desired": 3}},
        {"version": "v3", "state": "shadow"},
    ],
}


def test_versions_are_shown_stable_first_and_retired_ones_left_out() -> None:
    assert shown_versions(RESOURCE, None) == ["v1", "v2", "v3"]
    assert shown_versions(RESOURCE, "v0") == ["v0"]


def test_each_version_has_its_own_column() -> None:
    bodies = {"v1": _body(1200, 10.0), "v2": _body(120, 40.0, errors=6)}
    console = Console(record=True, width=160)
    console.print(stats_table("minilm", RESOURCE, bodies, window_s=300))
    text = console.export_text()
    assert "minilm v1, v2 over 300 s" in text
    assert "stable, 90 %" in text and "canary, 10 %" in text
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in text.splitlines() if line.count("│") >= 3}
    assert rows["queue wait ms p50"] == ["10.0", "40.0"]
    assert rows["queue wait ms p99"] == ["30.0", "-"]  # v2 has too few jobs for a p99
    assert rows["errors"] == ["0 (0.00%)", "6 (5.00%)"]
    assert rows["replicas live/desired"] == ["3/3", "1/2"]
    assert rows["padded / real tokens"] == ["1.25", "-"] and rows["cost per 1,000 jobs"] == ["0.0125", "-"]
    assert rows["time to fill ms p50"] == ["10.0", "40.0"]
    assert "p99 needs at least 300 jobs in the window (v2 had fewer)" in text
