"""What happens to a retired version's queue: pure, clock passed in.

Retiring a version stops its routing at once (the registry takes its weight and pins). What was
queued for it is still owed an answer, so the version stays placed, its workers serving, for
`drain_s` after it was retired; then every job it still has fails with `version_retired` (webhooks
queued, quota places freed: `sluice.wire.settling.fail_retired`), and only then does it leave the
placement, its weights unloaded (docs/ARCHITECTURE.md, "No job waits for a worker that will
never come"). A retired version with nothing queued leaves at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

VersionKey = tuple[str, str]
# How long after its drain limit a retired version's streams are still looked at: past it, a
# retired version costs the scheduler nothing.
WATCHED_AFTER_S = 3600.0


@dataclass(frozen=True, slots=True)
class Retiring:
    keep_placed: frozenset[VersionKey]  # still draining: workers serve what is queued
    fail_now: frozenset[VersionKey]  # past the drain limit with work left: fail it


def watched(retired_at: float, *, now: float, drain_s: float) -> bool:
    """Whether a version retired at `retired_at` may still have a queue to settle."""
    return now - retired_at <= drain_s + WATCHED_AFTER_S


def retiring(retired_at: Mapping[VersionKey, float], backlog: Mapping[VersionKey, int], *, now: float,
             drain_s: float) -> Retiring:
    keep: set[VersionKey] = set()
    fail: set[VersionKey] = set()
    for key, at in retired_at.items():
        if backlog.get(key, 0) <= 0:
            continue
        (keep if now < at + drain_s else fail).add(key)
    return Retiring(keep_placed=frozenset(keep), fail_now=frozenset(fail))
