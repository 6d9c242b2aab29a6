"""The `sluice` command's own checks, made before it touches a store."""

from __future__ import annotations

import re

from typer.testing import CliRunner

from launch.cli import app


def test_an_unknown_scheduler_actuator_is_a_usage_error_not_a_silent_none() -> None:
    done = CliRunner().invoke(app, ["scheduler", "--actuator", "kubernets"], env={"SLUICE_DATABASE_URL": ""})
    assert done.exit_code == 2, done.output
    said = " ".join(re.sub("[│╭╮╰╯─]", " ", done.output).split())  # as read, without rich's box
    assert "'kubernets' is not one of 'local', 'kubernetes', 'none'" in said, said


def test_sluice_models_says_a_version_is_scaled_to_zero_or_waking_and_where_it_runs_once_awake() -> None:
    from launch.models_cli import _placement

    base = {"desired": 0, "live": 0, "reason": "idle", "processes": [], "not_served": None}
    assert "scaled to zero" in _placement({**base, "scale_to_zero": "asleep"})
    assert "the next job wakes it" in _placement({**base, "scale_to_zero": "asleep"})
    assert "waking from zero" in _placement({**base, "desired": 1, "scale_to_zero": "waking"})
    awake = {**base, "desired": 1, "live": 1, "scale_to_zero": "awake",
             "processes": [{"group": "g3", "tier": "batch", "shares_with": []}]}
    assert _placement(awake).startswith("process g3 (batch)")
    assert _placement({**base, "scale_to_zero": None}) == "placed on no process"
