"""A version's defaults for its jobs' limits fill only what the request left out (api/routes/jobs.py)."""

from __future__ import annotations

from api.routes.jobs import version_defaults
from sluice.routing import VersionInfo

AT = 1_000.0


def _version(*, max_queue_s: float | None = None, run_timeout_s: float | None = None) -> VersionInfo:
    return VersionInfo(model="m", version="v1", state="stable", artifact="synthetic:", sha256="0" * 64,
                       max_queue_s=max_queue_s, run_timeout_s=run_timeout_s)


def test_a_version_without_defaults_leaves_the_request_s_limits_as_they_are() -> None:
    assert version_defaults(_version(), deadline=None, run_timeout_s=None, submitted_at=AT,
                            batch_timeout_s=120) == (None, None)
    assert version_defaults(_version(), deadline=AT + 5, run_timeout_s=3, submitted_at=AT,
                            batch_timeout_s=120) == (AT + 5, 3)


def test_the_defaults_fill_what_is_missing_and_a_request_s_own_limit_wins_either_way() -> None:
    version = _version(max_queue_s=60, run_timeout_s=10)
    assert version_defaults(version, deadline=None, run_timeout_s=None, submitted_at=AT,
                            batch_timeout_s=120) == (AT + 60, 10)
    assert version_defaults(version, deadline=AT + 600, run_timeout_s=None, submitted_at=AT,
                            batch_timeout_s=120) == (AT + 600, 10)
    assert version_defaults(version, deadline=AT + 1, run_timeout_s=0.5, submitted_at=AT,
                            batch_timeout_s=120) == (AT + 1, 0.5)
    assert version_defaults(version, deadline=None, run_timeout_s=90, submitted_at=AT,
                            batch_timeout_s=120) == (AT + 60, 90)


def test_a_default_run_limit_over_a_since_lowered_batch_timeout_is_cut_to_it() -> None:
    assert version_defaults(_version(run_timeout_s=100), deadline=None, run_timeout_s=None, submitted_at=AT,
                            batch_timeout_s=30) == (None, 30)
