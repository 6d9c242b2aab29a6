"""`sluice tune status`'s lines for one version resource (launch/tune_cli.py)."""

from __future__ import annotations

from typing import Any

from launch.tune_cli import describe


def _version(**batching: Any) -> dict[str, Any]:
    return {"version": "v1", "batching": {"max_batch_size": 8, "max_wait_ms": 5.0, **batching}}


def test_a_version_without_a_budget_says_it_is_not_re_tuned() -> None:
    assert describe("m", _version(p99_budget_ms=None)) == [
        "m v1: batch 8, wait 5 ms; no p99 budget (not re-tuned)", "  never tuned from a proposal"]


def test_a_tuned_version_shows_its_mix_its_proposal_with_the_gain_and_its_drift() -> None:
    on = {"mix": {"16": 80, "512": 20}, "samples": 100}
    lines = describe("m", _version(
        p99_budget_ms=150.0, auto_tune=True, tuned_at="2030-03-18T10:00:00+00:00", tuned_on=on,
        proposal={"max_batch_size": 2, "max_wait_ms": 0.0, "throughput_rps": 53.64, "p99_ms": 117.5, "gain": 0.121,
                  "on": {"mix": {"512": 8}, "samples": 8}},
        drift={"online": 0.6, "bulk": 0.05}))
    assert lines == [
        "m v1: batch 8, wait 5 ms; p99 budget 150 ms, auto_tune on",
        "  tuned at 2030-03-18T10:00:00+00:00 on 100 inputs (<=16: 80%, <=512: 20%)",
        "  proposal: batch 2, wait 0 ms, 53.6/s at p99 118 ms; gain +12.1% on 8 inputs (<=512: 100%)",
        "  drift from the tuned mix: bulk 0.05, online 0.60",
    ]
