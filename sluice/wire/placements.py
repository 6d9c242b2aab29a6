"""The placement plan on the wire: which worker process (group) serves which versions.

The scheduler (scheduler/placement.py decides it) writes the whole plan as one JSON string at
`keys.placements()`; each worker host reads its own group's entry, the API reads `not_served` to
refuse submissions no worker will ever take, and `GET /v1/models/{m}` shows who shares a process
with whom. One writer, whole-document writes: a reader never sees half a plan.

A worker refusing a version's artifact says so in `keys.refused_versions()`, which the scheduler
folds into `not_served` on its next tick.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.asyncio as aioredis

from sluice.errors import BrokerError
from sluice.wire import keys
from sluice.wire.connections import translate_redis_errors

VersionKey = tuple[str, str]


def version_name(key: VersionKey) -> str:
    return f"{key[0]}/{key[1]}"


@dataclass(frozen=True, slots=True)
class PlacedVersion:
    model: str
    version: str
    config: str  # what its Worker reads from the registry once (scheduler.scaling.worker_config)

    @property
    def key(self) -> VersionKey:
        return self.model, self.version


@dataclass(frozen=True, slots=True)
class Group:
    """One worker process and what it serves."""

    tier: str  # latency, batch, or mixed when the operator lets tiers share a process
    threads: int
    versions: tuple[PlacedVersion, ...]


@dataclass(frozen=True, slots=True)
class PlacementPlan:
    at: float
    groups: Mapping[str, Group] = field(default_factory=dict)
    not_served: Mapping[str, str] = field(default_factory=dict)  # "model/version" -> reason

    def groups_of(self, key: VersionKey) -> list[str]:
        return sorted(name for name, group in self.groups.items() if any(p.key == key for p in group.versions))

    def shares_with(self, key: VersionKey, group: str) -> list[str]:
        return sorted(version_name(p.key) for p in self.groups[group].versions if p.key != key)

    def to_json(self) -> str:
        return json.dumps({
            "at": self.at,
            "groups": {name: {"tier": g.tier, "threads": g.threads,
                              "versions": [{"model": p.model, "version": p.version, "config": p.config}
                                           for p in g.versions]}
                       for name, g in sorted(self.groups.items())},
            "not_served": dict(sorted(self.not_served.items())),
        }, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes | None) -> PlacementPlan | None:
        if not raw:
            return None
        try:
            data: dict[str, Any] = json.loads(raw)
            groups = {name: Group(tier=str(g["tier"]), threads=int(g["threads"]), versions=tuple(
                PlacedVersion(model=str(p["model"]), version=str(p["version"]), config=str(p["config"]))
                for p in g["versions"])) for name, g in data.get("groups", {}).items()}
            return cls(at=float(data["at"]), groups=groups,
                       not_served={str(k): str(v) for k, v in data.get("not_served", {}).items()})
        except (ValueError, KeyError, TypeError) as exc:
            raise BrokerError(f"unreadable placement plan: {exc}") from exc


def write(client: redis.Redis, plan: PlacementPlan) -> None:
    with translate_redis_errors():
        client.set(keys.placements(), plan.to_json())


def queue_write(pipe: Any, plan: PlacementPlan) -> None:
    """Add the plan's write to a pipeline, beside the decisions it goes with."""
    pipe.set(keys.placements(), plan.to_json())


def read(client: redis.Redis) -> PlacementPlan | None:
    with translate_redis_errors():
        raw: bytes | None = client.get(keys.placements())  # type: ignore[assignment]
    return PlacementPlan.from_json(raw)


async def read_async(client: aioredis.Redis) -> PlacementPlan | None:
    with translate_redis_errors():
        raw: bytes | str | None = await client.get(keys.placements())
    return PlacementPlan.from_json(raw)


def refused(client: redis.Redis) -> dict[str, str]:
    """Versions a worker refused to load, with why."""
    with translate_redis_errors():
        raw: dict[bytes, bytes] = client.hgetall(keys.refused_versions())  # type: ignore[assignment]
    return {k.decode(): v.decode() for k, v in raw.items()}


async def record_refusal(client: aioredis.Redis, key: VersionKey, reason: str) -> None:
    with translate_redis_errors():
        await client.hset(keys.refused_versions(), version_name(key), reason)  # type: ignore[misc]


async def clear_refusal(client: aioredis.Redis, key: VersionKey) -> None:
    with translate_redis_errors():
        await client.hdel(keys.refused_versions(), version_name(key))  # type: ignore[misc]
