"""Routing a job to a model version: explicit version, then pin, then weighted hash.

Pure: it reads a `RoutingSnapshot` (what the registry said at load time) and returns a decision,
so the API, the simulator and tests share it. The weighted choice hashes the routing key, so one
caller keeps landing on one version for as long as the weights stay as they are.

A version in state `shadow` never serves: its weight is the percentage of the stable version's
jobs copied to it (`shadow_target`). Versions whose circuit breaker is open (`blocked`) lose
their unpinned traffic to the stable version; callers pinned to one, or naming it, get a 503.
A tenant may not name a `staged` or `shadow` version, by a pin or in the request (403
`not_servable`); admin keys may, to smoke-test a version before it takes traffic.
"""

from __future__ import annotations

import hashlib
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Literal

from sluice.errors import Conflict, Forbidden, NoServableVersion, NotFound, NotServable, ServiceUnavailable
from sluice.versions import PRIMARY_STATES, VersionState

RouteReason = Literal["explicit", "pin", "weighted", "fallback"]

# Versions a tenant may not name: they take traffic only by weight, or only copies (shadow).
NOT_NAMEABLE = frozenset({VersionState.staged, VersionState.shadow})


@dataclass(frozen=True, slots=True)
class VersionInfo:
    model: str
    version: str
    state: str
    artifact: str
    sha256: str
    max_batch_size: int = 32
    max_wait_ms: float = 10.0
    isolate_tenants: bool = True
    min_replicas: int = 1
    max_replicas: int = 4
    latency_budget_ms: float = 2000.0
    cache_ttl_s: int = 0  # > 0: the version's response cache keeps outputs this long
    handler: str | None = None  # kind `handler`: "package.module:Class"
    input_schema: str | None = None  # the declared JSON Schema of one input, canonical JSON
    retired_at: float | None = None  # unix time it was retired (its drain limit counts from it)
    # Defaults for a job naming no limit of its own: seconds it may wait to start, and its run limit.
    max_queue_s: float | None = None
    run_timeout_s: float | None = None


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    kind: str
    versions: dict[str, VersionInfo] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    tier: str = "latency"


@dataclass(frozen=True, slots=True)
class RoutingSnapshot:
    models: dict[str, ModelInfo] = field(default_factory=dict)
    pins: dict[tuple[str, str], str] = field(default_factory=dict)  # (tenant, model) -> version

    def model(self, name: str) -> ModelInfo:
        info = self.models.get(name)
        if info is None:
            raise NotFound(f"model '{name}' does not exist")
        return info


@dataclass(frozen=True, slots=True)
class RouteDecision:
    version: VersionInfo
    reason: RouteReason
    fallback_from: str | None = None


def hash_unit(model: str, routing_key: str) -> float:
    """A stable point in [0, 1) for this (model, key)."""
    digest = hashlib.sha256(f"{model}\x00{routing_key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def _exact(info: ModelInfo, version: str, blocked: Container[str], *, admin: bool) -> VersionInfo:
    found = info.versions.get(version)
    if found is None:
        raise NotFound(f"model '{info.name}' has no version '{version}'")
    if found.state == VersionState.retired:
        raise Conflict(f"version '{version}' of model '{info.name}' is retired")
    if found.state in NOT_NAMEABLE and not admin:
        raise NotServable(f"version '{version}' of model '{info.name}' is {found.state}: only admin keys may name it")
    if version in blocked:
        raise ServiceUnavailable(
            f"version '{version}' of model '{info.name}' is unavailable: its circuit breaker is open",
            headers={"Retry-After": "5"},
        )
    return found


def _fallback(info: ModelInfo, chosen: VersionInfo, blocked: Container[str]) -> RouteDecision:
    for name in sorted(info.versions):
        candidate = info.versions[name]
        if candidate.state == VersionState.stable and name not in blocked and name != chosen.version:
            return RouteDecision(candidate, "fallback", fallback_from=chosen.version)
    # No healthy stable version to move to: queueing on the chosen one beats refusing the job.
    return RouteDecision(chosen, "weighted")


def route(
    snapshot: RoutingSnapshot,
    *,
    model: str,
    tenant: str,
    routing_key: str | None = None,
    version: str | None = None,
    blocked: Container[str] = frozenset(),
    admin: bool = False,
) -> RouteDecision:
    info = snapshot.model(model)
    pinned = snapshot.pins.get((tenant, model))
    if version is not None:
        if pinned is not None and pinned != version:
            raise Forbidden(
                f"tenant '{tenant}' is pinned to version '{pinned}' of '{model}' and may not use '{version}'"
            )
        return RouteDecision(_exact(info, version, blocked, admin=admin), "explicit")
    if pinned is not None:
        return RouteDecision(_exact(info, pinned, blocked, admin=admin), "pin")
    candidates = sorted(
        (v, w)
        for v, w in info.weights.items()
        if w > 0 and v in info.versions and info.versions[v].state in PRIMARY_STATES
    )
    total = sum(w for _, w in candidates)
    if total <= 0:
        raise NoServableVersion(f"model '{model}' has no version with routing weight")
    point = hash_unit(model, routing_key or tenant) * total
    running = 0.0
    chosen = info.versions[candidates[-1][0]]
    for name, weight in candidates:
        running += weight
        if point < running:
            chosen = info.versions[name]
            break
    if chosen.version in blocked:
        return _fallback(info, chosen, blocked)
    return RouteDecision(chosen, "weighted")


def shadow_target(snapshot: RoutingSnapshot, *, model: str, primary: VersionInfo, point: float) -> str | None:
    """The shadow version a job of `primary` is copied to, if `point` (uniform in [0, 1)) falls in
    its sample. Only the stable version is shadowed: agreement is always measured against it."""
    if primary.state != VersionState.stable:
        return None
    info = snapshot.model(model)
    for name in sorted(info.versions):
        rate = min(100.0, max(0.0, info.weights.get(name, 0.0))) / 100.0
        if info.versions[name].state == VersionState.shadow and name != primary.version and point < rate:
            return name
    return None
