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
