"""The states of a model version, defined once: the API's fields, the registry's check
constraint, the router and the rollouts all derive from `VersionState`.

A version's weight means two things: for `staged`, `canary` and `stable` it is a share of the
callers' traffic, for `shadow` the percentage of stable's jobs copied to it (a shadow version
never answers a caller). `retired` takes nothing: no weight, no pin, no worker.
"""

from __future__ import annotations

from enum import StrEnum


class VersionState(StrEnum):
    staged = "staged"
    shadow = "shadow"
    canary = "canary"
    stable = "stable"
    retired = "retired"


class Tier(StrEnum):
    """A model's availability tier: its versions share worker processes only with versions of
    the same tier (unless packing across tiers), and the latency tier takes spare processes first
    (scheduler/placement.py)."""

    latency = "latency"
    batch = "batch"


# Every state a worker runs a version in, and so the ones a version may be registered in.
SERVING_STATES = frozenset(VersionState) - {VersionState.retired}
# The states whose weight is a share of the callers' traffic.
PRIMARY_STATES = SERVING_STATES - {VersionState.shadow}
