"""Which worker processes serve which versions: pure, no clock, no I/O.

The autoscaler (scheduler/scaling.py) says how many processes each version should be on; the
`Placer` decides which. The rules (docs/ARCHITECTURE.md, "Placement"):

1. **Pools.** With `pack_across_tiers` every tier shares one pool; otherwise each tier present
   has its own, and a latency version never shares a process with a batch one.
2. **Sticky.** Groups keep their ids and the versions they hold while those are still wanted;
   ids are never reused (a counter that only grows), so a process, a log file or a Deployment
   named after a group always means one thing. A version no longer wanted leaves every group; a
   group left empty closes.
3. **Order.** Versions are placed latency tier first, serving before shadow, floor deficits
   before scale-up, then by key. A version held on more processes than wanted leaves the
   youngest group first, so the groups a spike opened are the ones that empty and close.
4. **Where a placement goes.** The pool's groups that do not hold the version and have room in
   memory (a group's memory is the sum of `resident_bytes` over the distinct `weights` it holds:
   weights already there cost nothing); a group already holding the same weights first, then the
   oldest. With none, a new group opens while the pool is under its share of processes; a floor
   placement opens one even over the budget (its change line says so), since the budget bounds
   processes and threads, never whether a version is served; a scale-up placement without room
   stops there, and the version runs on fewer processes than it asked for.
5. **Shares.** Each pool may use at least `max(1, its largest floor)` processes; the rest of the
   budget goes to the latency pool first, then the batch one, as far as their largest `replicas`
   asks. At the floor (every version asking for one process) each pool is one process holding
   all its versions.
6. **Not served.** A version whose weights alone exceed `memory_per_process` cannot be placed,
   and is reported with why; every other version is placed on at least its floor.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from scheduler.autoscale import Tier
from sluice.wire.placements import Group, PlacedVersion, PlacementPlan, version_name

VersionKey = tuple[str, str]
MIXED = "mixed"
_GROUP_ID = re.compile(r"^g(\d+)$")


@dataclass(frozen=True, slots=True)
class Want:
    """One version's demand on the placement."""

    tier: Tier
    floor: int  # min_replicas: placed on at least this many processes, whatever the budget
    replicas: int  # what the lag policy asks for (floor <= replicas)
    weights: str  # versions with equal `weights` share one loaded copy in a process
    resident_bytes: int  # what one copy costs in a process (measured, else an estimate)
    config: str = ""  # passed through to the plan (scheduler.scaling.worker_config)
    serving: bool = True  # False for a shadow version: it answers no caller


@dataclass(frozen=True, slots=True)
class Budget:
    processes: int  # worker processes the cores give (one per worker slot)
    threads_per_process: int
    memory_per_process: int  # bytes of loaded weights one process may hold
    pack_across_tiers: bool


@dataclass(frozen=True, slots=True)
class GroupPlan:
    tier: str  # latency, batch, or mixed (packed across tiers, holding both)
    threads: int
    versions: frozenset[VersionKey]


@dataclass(frozen=True, slots=True)
class Placed:
    groups: Mapping[str, GroupPlan]  # no empty group
    not_served: Mapping[VersionKey, str]  # versions that could not be placed at all, with why
    changes: tuple[str, ...]  # one line per change since the last placement, with its reason
    wants: Mapping[VersionKey, Want] = field(default_factory=dict)

    def replicas(self, key: VersionKey) -> int:
        return sum(1 for group in self.groups.values() if key in group.versions)

    def to_plan(self, *, at: float) -> PlacementPlan:
        """The plan as the wire carries it: each version with the configuration it runs."""
        return PlacementPlan(
            at=at,
            groups={name: Group(tier=group.tier, threads=group.threads, versions=tuple(
                PlacedVersion(model=key[0], version=key[1], config=self.wants[key].config)
                for key in sorted(group.versions) if key in self.wants)) for name, group in self.groups.items()},
            not_served={version_name(key): why for key, why in self.not_served.items()})


def _group_number(name: str) -> int:
    found = _GROUP_ID.match(name)
    return int(found.group(1)) if found else 0


def _mb(size: int) -> str:
    return f"{size / 2**20:.0f} MB"


class Placer:
    """Remembers the groups between placements (rule 2); `place` is the whole decision."""

    def __init__(self, *, groups: Mapping[str, GroupPlan] | None = None) -> None:
        self._groups: dict[str, set[VersionKey]] = {name: set(g.versions) for name, g in (groups or {}).items()}
        self._tiers: dict[str, str] = {name: g.tier for name, g in (groups or {}).items()}
        self._ids = itertools.count(max((_group_number(name) for name in self._groups), default=0) + 1)

    def place(self, wants: Mapping[VersionKey, Want], budget: Budget) -> Placed:
        changes: list[str] = []
        not_served = {key: f"its weights ({_mb(want.resident_bytes)}) exceed the "
                           f"{_mb(budget.memory_per_process)} one process may hold"
                      for key, want in wants.items() if want.resident_bytes > budget.memory_per_process}
        placeable = {key: want for key, want in wants.items() if key not in not_served}
        self._repool(placeable, budget)
        self._leave(placeable, budget, changes)
        shares = self._shares(placeable, budget)
        order = sorted(placeable, key=lambda k: _order(k, placeable[k]))
        for floor in (True, False):
            for key in order:
                want = placeable[key]
                pool = self._pool(want.tier, budget)
                while self._held(key) < (want.floor if floor else want.replicas):
                    if not self._add(key, want, pool, placeable, budget, shares[pool], floor=floor, changes=changes):
                        break
        for name in [name for name, members in self._groups.items() if not members]:
            del self._groups[name]
            del self._tiers[name]
            changes.append(f"{name} closed: it serves no version")
        groups = {name: GroupPlan(tier=self._tier_of(name, placeable), threads=budget.threads_per_process,
                                  versions=frozenset(members))
                  for name, members in sorted(self._groups.items(), key=lambda item: _group_number(item[0]))}
        return Placed(groups=groups, not_served=not_served, changes=tuple(changes), wants=dict(wants))

    # --- the steps --------------------------------------------------------------------------------

    def _repool(self, wants: Mapping[VersionKey, Want], budget: Budget) -> None:
        """Each group's pool under this budget's packing: all one pool when packing across tiers;
        otherwise a mixed group (packing was on) becomes the pool of its first version's tier, and
        `_leave` moves the others out."""
        for name, members in self._groups.items():
            if budget.pack_across_tiers:
                self._tiers[name] = MIXED
            elif self._tiers[name] not in ("latency", "batch"):
                tiers = sorted(wants[key].tier for key in members if key in wants)
                self._tiers[name] = tiers[0] if tiers else "latency"

    def _leave(self, wants: Mapping[VersionKey, Want], budget: Budget, changes: list[str]) -> None:
        """Rules 2 and 3: what is no longer wanted, or wanted on fewer processes, or in a group of
        another pool now (the tiers' packing changed), leaves; youngest groups first."""
        for name in sorted(self._groups, key=_group_number, reverse=True):
            for key in sorted(self._groups[name]):
                want = wants.get(key)
                if want is None:
                    self._groups[name].discard(key)
                    changes.append(f"{name}: - {version_name(key)} (no longer placed)")
                elif self._tiers[name] != self._pool(want.tier, budget):
                    self._groups[name].discard(key)
                    changes.append(f"{name}: - {version_name(key)} (its tier's processes changed)")
        for name in sorted(self._groups, key=_group_number, reverse=True):
            for key in sorted(self._groups[name], reverse=True):
                if len(self._groups[name]) == 1 or self._memory(name, wants) <= budget.memory_per_process:
                    break
                self._groups[name].discard(key)
                changes.append(f"{name}: - {version_name(key)} (the process is over its memory)")
        for key, want in wants.items():
            surplus = self._held(key) - want.replicas
            for name in sorted(self._groups, key=_group_number, reverse=True):
                if surplus <= 0:
                    break
                if key in self._groups[name]:
                    self._groups[name].discard(key)
                    surplus -= 1
                    changes.append(f"{name}: - {version_name(key)} (scaled down to {want.replicas})")

    def _shares(self, wants: Mapping[VersionKey, Want], budget: Budget) -> dict[str, int]:
        """Rule 5: the processes each pool may open for scale-up."""
        pools: dict[str, list[Want]] = {}
        for want in wants.values():
            pools.setdefault(self._pool(want.tier, budget), []).append(want)
        shares = {pool: max(1, *(w.floor for w in members)) for pool, members in pools.items()}
        left = budget.processes - sum(shares.values())
        for pool in sorted(pools, key=lambda p: 0 if p in ("latency", MIXED) else 1):
            extra = min(max(0, left), max(w.replicas for w in pools[pool]) - shares[pool])
            if extra > 0:
                shares[pool] += extra
                left -= extra
        return shares

    def _add(self, key: VersionKey, want: Want, pool: str, wants: Mapping[VersionKey, Want], budget: Budget,
             share: int, *, floor: bool, changes: list[str]) -> bool:
        """Rule 4: one more process for `key`; False when there is none to be had."""
        candidates = [name for name in self._groups if self._tiers[name] == pool and key not in self._groups[name]
                      and self._memory(name, wants, adding=want) <= budget.memory_per_process]
        if candidates:
            sharing = [name for name in candidates if want.weights in self._weights(name, wants)]
            name = min(sharing or candidates, key=_group_number)
            self._groups[name].add(key)
            reason = "its floor" if floor else f"scale-up to {want.replicas}"
            if sharing:
                reason += "; shares weights already loaded there"
            changes.append(f"{name}: + {version_name(key)} ({reason})")
            return True
        in_pool = sum(1 for name in self._groups if self._tiers[name] == pool)
        if in_pool >= share and not floor:
            return False
        name = f"g{next(self._ids)}"
        # A group emptied by this plan closes at its end: it is no process.
        over = sum(1 for members in self._groups.values() if members) >= budget.processes
        self._groups[name], self._tiers[name] = {key}, pool
        reason = "its floor" if floor else f"scale-up to {want.replicas}"
        if over:
            reason += f": over the {budget.processes}-process budget to keep {version_name(key)} served"
        changes.append(f"{name} opened ({pool}): + {version_name(key)} ({reason})")
        return True

    # --- reading the groups ---------------------------------------------------------------------

    def _pool(self, tier: str, budget: Budget) -> str:
        return MIXED if budget.pack_across_tiers else tier

    def _held(self, key: VersionKey) -> int:
        return sum(1 for members in self._groups.values() if key in members)

    def _weights(self, name: str, wants: Mapping[VersionKey, Want]) -> set[str]:
        return {wants[key].weights for key in self._groups[name] if key in wants}

    def _memory(self, name: str, wants: Mapping[VersionKey, Want], *, adding: Want | None = None) -> int:
        held: dict[str, int] = {}
        members: Iterable[Want] = [wants[key] for key in self._groups[name] if key in wants]
        for want in [*members, *([adding] if adding else [])]:
            held[want.weights] = max(held.get(want.weights, 0), want.resident_bytes)
        return sum(held.values())

    def _tier_of(self, name: str, wants: Mapping[VersionKey, Want]) -> str:
        tiers = {wants[key].tier for key in self._groups[name] if key in wants}
        return tiers.pop() if len(tiers) == 1 else MIXED


def _order(key: VersionKey, want: Want) -> tuple[int, int, str, str]:
    return (0 if want.tier == "latency" else 1, 0 if want.serving else 1, *key)
