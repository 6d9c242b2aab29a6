"""Routing a job to a model version: explicit version, then pin, then weighted hash.

Pure: it reads a `RoutingSnapshot` (what the registry said at load time) and returns a decision,
so the API, the simulator and tests share it. The weighted choice hashes the routing key, so one
caller keeps landing on one version for as long as the weights stay as they are.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Literal

from sluice.errors import Conflict, Forbidden, NotFound, ServiceUnavailable

RouteReason = Literal["explicit", "pin", "weighted"]
SERVING_STATES = frozenset({"staged", "shadow", "canary", "stable"})


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


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    kind: str
    versions: dict[str, VersionInfo] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)


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


def hash_unit(model: str, routing_key: str) -> float:
    """A stable point in [0, 1) for this (model, key)."""
    digest = hashlib.sha256(f"{model}\x00{routing_key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def _exact(info: ModelInfo, version: str) -> VersionInfo:
    found = info.versions.get(version)
    if found is None:
        raise NotFound(f"model '{info.name}' has no version '{version}'")
    if found.state == "retired":
        raise Conflict(f"version '{version}' of model '{info.name}' is retired")
    return found


def route(
    snapshot: RoutingSnapshot,
    *,
    model: str,
    tenant: str,
    routing_key: str | None = None,
    version: str | None = None,
) -> RouteDecision:
    info = snapshot.model(model)
    pinned = snapshot.pins.get((tenant, model))
    if version is not None:
        if pinned is not None and pinned != version:
            raise Forbidden(
                f"tenant '{tenant}' is pinned to version '{pinned}' of '{model}' and may not use '{version}'"
            )
        return RouteDecision(_exact(info, version), "explicit")
    if pinned is not None:
        return RouteDecision(_exact(info, pinned), "pin")
    candidates = sorted(
        (v, w)
        for v, w in info.weights.items()
        if w > 0 and v in info.versions and info.versions[v].state in SERVING_STATES
    )
    total = sum(w for _, w in candidates)
    if total <= 0:
        raise ServiceUnavailable(f"model '{model}' has no version with routing weight")
    point = hash_unit(model, routing_key or tenant) * total
    running = 0.0
    for name, weight in candidates:
        running += weight
        if point < running:
            return RouteDecision(info.versions[name], "weighted")
    return RouteDecision(info.versions[candidates[-1][0]], "weighted")
