"""The scheduler's autoscaling step: what Redis shows of each pool in, replicas per version out.

`read_pools` reads, in two pipelined round trips for all versions, each lane's stream (its
length: jobs queued or running, since finished entries are deleted; and `entries-added`, the
monotonic arrival count) and the live workers' heartbeats. `Autoscaler.decide` turns those into
`PoolSignals`, asks `scheduler.autoscale` for each version's need, stabilizes it, and has
`scheduler.placement` place it on that many worker processes; `publish` leaves the decisions and
the placement plan where the API, the worker processes and dashboards read them, and `withdraw`
takes away the series of versions no longer scaled.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import redis

from scheduler.autoscale import LaneLoad, PoolSignals, RateTracker, ScalingPolicy, Stabilizer, Tier, need
from scheduler.idle import Activity, IdlePolicy, IdleWatch
from scheduler.placement import Budget, GroupPlan, Placed, Placer, Want
from sluice.metrics import DESIRED_REPLICAS, LIVE_REPLICAS, STREAM_LAG
from sluice.routing import ModelInfo, RoutingSnapshot, VersionInfo
from sluice.versions import VersionState
from sluice.vocabulary import LANES, ZeroState
from sluice.wire import keys, placements
from sluice.wire.connections import translate_redis_errors
from sluice.wire.heartbeats import Heartbeat, WorkerState, live_since
from sluice.wire.placements import PlacementPlan

log = logging.getLogger(__name__)

VersionKey = tuple[str, str]
# The scheduler's decision outlives a few missed ticks, not a scheduler that is gone.
DECISION_TTL_S = 60
# What one loaded copy of a version's weights is taken to cost until a worker has measured it.
DEFAULT_RESIDENT_BYTES = 256 * 2**20


@dataclass(frozen=True, slots=True)
class LaneReading:
    queued: int  # jobs waiting or running: the stream's entries and the jobs held (queue.lua)
    added: int  # entries ever added (XINFO STREAM entries-added); a held job counts once released


@dataclass(frozen=True, slots=True)
class PoolReading:
    online: LaneReading
    bulk: LaneReading
    beats: tuple[Heartbeat, ...]
    workers: tuple[str, ...] = ()  # each beat's worker (consumer name), in the same order

    @property
    def ready(self) -> list[Heartbeat]:
        return [beat for beat in self.beats if beat.state == WorkerState.ready]

    @property
    def ready_workers(self) -> frozenset[str]:
        return frozenset(name for name, beat in zip(self.workers, self.beats, strict=False)
                         if beat.state == WorkerState.ready)


@dataclass(frozen=True, slots=True)
class ScaleDecision:
    replicas: int  # processes the version is placed on
    desired: int  # what the version needs (stabilized, clamped), before the budget
    reason: str
    zero: ZeroState | None = None  # a version with min_replicas 0: asleep, waking or awake (scheduler/idle.py)


def _field(info: Mapping[Any, Any], name: str) -> int:
    value = info.get(name, info.get(name.encode(), 0))
    return int(value or 0)


def _held(reply: Any) -> int:
    return 0 if isinstance(reply, Exception) or reply is None else int(reply)


def read_pools(client: redis.Redis, versions: Iterable[VersionKey], *, now: float) -> dict[VersionKey, PoolReading]:
    versions = list(versions)
    pipe = client.pipeline(transaction=False)
    for model, version in versions:
        for lane in LANES:
            pipe.xinfo_stream(keys.stream(model, version, lane))
        for lane in LANES:
            pipe.hget(keys.held_index(model, version, lane), "*")
        pipe.zrangebyscore(keys.live_workers(model, version), live_since(now), "+inf")
    with translate_redis_errors():
        replies = pipe.execute(raise_on_error=False)
    lanes: dict[VersionKey, list[LaneReading]] = {}
    names: dict[VersionKey, list[str]] = {}
    for index, key in enumerate(versions):
        online, bulk, held_online, held_bulk, workers = replies[5 * index: 5 * index + 5]
        # A stream nobody has written to yet does not exist: an empty lane.
        lanes[key] = [LaneReading(queued=_field(info, "length") + _held(held),
                                  added=_field(info, "entries-added"))
                      if isinstance(info, dict) else LaneReading(_held(held), 0)
                      for info, held in ((online, held_online), (bulk, held_bulk))]
        names[key] = [] if isinstance(workers, Exception) else [name.decode() for name in workers]
    pipe = client.pipeline(transaction=False)
    for key in versions:
        for name in names[key]:
            pipe.hgetall(keys.heartbeat(*key, name))
    with translate_redis_errors():
        beats = iter(pipe.execute() if any(names.values()) else [])
    readings = {}
    for key in versions:
        found = [(name, next(beats)) for name in names[key]]
        readings[key] = PoolReading(online=lanes[key][0], bulk=lanes[key][1],
                                    beats=tuple(Heartbeat.from_fields(raw) for _, raw in found if raw),
                                    workers=tuple(name for name, raw in found if raw))
    return readings


@dataclass(frozen=True, slots=True)
class ScaledVersion:
    info: VersionInfo
    tier: Tier
    kind: str = ""


def _scaled(model: ModelInfo, info: VersionInfo) -> ScaledVersion:
    return ScaledVersion(info=info, tier="batch" if model.tier == "batch" else "latency", kind=model.kind)


def scaled_versions(snapshot: RoutingSnapshot) -> dict[VersionKey, ScaledVersion]:
    """Every version that can be asked for (all but retired) and may have workers, with its model's tier."""
    return {
        (model.name, version.version): _scaled(model, version)
        for model in snapshot.models.values()
        for version in model.versions.values()
        if version.state != VersionState.retired and version.max_replicas > 0
    }


def retired_versions(snapshot: RoutingSnapshot) -> dict[VersionKey, float]:
    """Retired versions with when they were retired."""
    return {(model.name, version.version): version.retired_at
            for model in snapshot.models.values() for version in model.versions.values()
            if version.state == VersionState.retired and version.retired_at is not None}


def draining_versions(snapshot: RoutingSnapshot, keep: Iterable[VersionKey]) -> dict[VersionKey, ScaledVersion]:
    """Retired versions still finishing their queue (`keep`): one process each, until drained."""
    found = {}
    for key in keep:
        model = snapshot.models.get(key[0])
        info = model.versions.get(key[1]) if model else None
        if model is not None and info is not None:
            found[key] = _scaled(model, replace(info, min_replicas=1, max_replicas=1))
    return found


def worker_config(info: VersionInfo) -> str:
    """What a version's Worker reads from the registry once, at start: a change means a new Worker
    for it beside the old one, which then drains (workers/host.py)."""
    return (f"{info.artifact}@{info.sha256} batch={info.max_batch_size} wait_ms={info.max_wait_ms:g} "
            f"isolate_tenants={info.isolate_tenants}")


def weights_identity(scaled: ScaledVersion) -> str:
    """Versions with equal identities share one loaded copy in a process (workers/models/shared.py)."""
    return f"{scaled.kind}|{scaled.info.artifact}@{scaled.info.sha256}|{scaled.info.handler or ''}"


def live_processes(reading: PoolReading) -> int:
    """Processes serving the version or starting to: its live heartbeats, one per group."""
    beats = [beat for beat in reading.beats if beat.state in (WorkerState.starting, WorkerState.ready)]
    return len({beat.group or f"pid {beat.pid}" for beat in beats})


class Autoscaler:
    """Each version's need from its lag (scheduler/autoscale.py), then where it runs
    (scheduler/placement.py): the need is a count of processes to be placed on, and every version
    with a floor is placed whatever the budget."""

    def __init__(self, *, policy: ScalingPolicy, budget: Budget, estimate_bytes: int = DEFAULT_RESIDENT_BYTES,
                 idle: IdlePolicy | None = None) -> None:
        self.policy = policy
        self.budget = budget
        self.idle = idle or IdlePolicy()
        self._watches: dict[VersionKey, IdleWatch] = {}  # the versions with min_replicas 0
        self.estimate_bytes = estimate_bytes
        self.placer = Placer()
        self._trackers: dict[tuple[VersionKey, str], RateTracker] = {}
        self._stabilizers: dict[VersionKey, Stabilizer] = {}
        self.desired: dict[VersionKey, int] = {}  # stabilized need

    def resume(self, plan: PlacementPlan) -> None:
        """Place from where a previous scheduler left off (its published plan)."""
        self.placer = Placer(groups={name: GroupPlan(tier=group.tier, threads=group.threads,
                                                     versions=frozenset(p.key for p in group.versions))
                                     for name, group in plan.groups.items()})

    def decide(self, versions: Mapping[VersionKey, ScaledVersion], readings: Mapping[VersionKey, PoolReading], *,
               now: float) -> tuple[dict[VersionKey, ScaleDecision], Placed]:
        needs: dict[VersionKey, tuple[int, str, int]] = {}  # desired, reason, floor
        zeros: dict[VersionKey, ZeroState] = {}
        for key, scaled in versions.items():
            info, reading = scaled.info, readings[key]
            loads = {}
            for lane, lane_reading in (("online", reading.online), ("bulk", reading.bulk)):
                tracker = self._trackers.setdefault((key, lane), RateTracker())
                rate = tracker.observe(now, lane_reading.added)
                loads[lane] = LaneLoad(backlog=lane_reading.queued, arrival_rate=rate.rate, trend=rate.trend)
            ready = reading.ready
            ready_processes = len({beat.group or beat.pid for beat in ready})
            floor, woke = info.min_replicas, ""
            if info.min_replicas == 0:
                watch = self._watches.setdefault(key, IdleWatch(policy=self.idle))
                zero = watch.observe(now, Activity(backlog=reading.online.queued + reading.bulk.queued,
                                                   arrived=reading.online.added + reading.bulk.added,
                                                   ready=reading.ready_workers))
                zeros[key] = zero.state
                if zero.state is not ZeroState.awake:
                    # Asleep: the idle period was the stabilization, no window of older
                    # recommendations holds a replica past it. Waking: one process until its worker
                    # is ready; nothing is measured before, and the lag policy's "one more while work
                    # waits" would add a process every tick of the cold start.
                    self._stabilizers.pop(key, None)
                    needs[key] = (zero.floor, zero.reason, zero.floor)
                    continue
                floor, woke = zero.floor, f"; {zero.reason}"
            else:
                self._watches.pop(key, None)
            measured = [beat.items_per_s for beat in ready if beat.items_per_s > 0]
            colds = [beat.cold_start_s for beat in reading.beats if beat.cold_start_s > 0]
            signals = PoolSignals(
                online=loads["online"], bulk=loads["bulk"],
                service_rate=sum(measured) / len(measured) if measured else None,
                cold_start_s=max(colds) if colds else None, live=live_processes(reading),
                ready=ready_processes, min_replicas=floor, max_replicas=info.max_replicas)
            needed = need(signals, self.policy)
            stabilizer = self._stabilizers.setdefault(key, Stabilizer(policy=self.policy))
            desired, held = stabilizer.apply(now, needed.replicas, self.desired.get(key, floor))
            needs[key] = (desired, needed.reason + held + woke, floor)
        for gone in set(self.desired).difference(versions):
            del self.desired[gone]
            self._stabilizers.pop(gone, None)
            self._watches.pop(gone, None)
            for lane in LANES:
                self._trackers.pop((gone, lane), None)
        placed = self.placer.place(self._wants(versions, readings, needs), self.budget)
        for change in placed.changes:
            log.info("placement: %s", change)
        decisions = {}
        for key, (desired, reason, _) in needs.items():
            replicas = placed.replicas(key)
            if key in placed.not_served:
                reason += f"; not placed: {placed.not_served[key]}"
            elif replicas < desired:
                reason += f"; on {replicas} of {desired} processes within the {self.budget.processes}-process budget"
            if self.desired.get(key) != desired:
                log.info("scale %s/%s to %d (was %s): %s", *key, desired, self.desired.get(key, "unset"), reason)
            self.desired[key] = desired
            decisions[key] = ScaleDecision(replicas=replicas, desired=desired, reason=reason, zero=zeros.get(key))
        return decisions, placed

    def _wants(self, versions: Mapping[VersionKey, ScaledVersion], readings: Mapping[VersionKey, PoolReading],
               needs: Mapping[VersionKey, tuple[int, str, int]]) -> dict[VersionKey, Want]:
        weights = {key: weights_identity(scaled) for key, scaled in versions.items()}
        measured: dict[str, int] = {}
        for key, identity in weights.items():
            for beat in readings[key].beats:
                measured[identity] = max(measured.get(identity, 0), beat.resident_bytes)
        return {key: Want(tier=scaled.tier, floor=min(needs[key][2], needs[key][0]),
                          replicas=needs[key][0], weights=weights[key],
                          resident_bytes=measured.get(weights[key]) or self.estimate_bytes,
                          config=worker_config(scaled.info), serving=scaled.info.state != VersionState.shadow)
                for key, scaled in versions.items()}


def publish(client: redis.Redis, decisions: Mapping[VersionKey, ScaleDecision],
            readings: Mapping[VersionKey, PoolReading], plan: PlacementPlan) -> None:
    """The placement plan, metrics, and one hash per version that `GET /v1/models/{m}` shows as
    `replicas`."""
    pipe = client.pipeline(transaction=False)
    placements.queue_write(pipe, plan)
    for key, decision in decisions.items():
        running = live_processes(readings[key])
        DESIRED_REPLICAS.labels(*key).set(decision.replicas)
        LIVE_REPLICAS.labels(*key).set(running)
        reading = readings[key]
        for lane, lane_reading in (("online", reading.online), ("bulk", reading.bulk)):
            STREAM_LAG.labels(*key, lane).set(lane_reading.queued)
        pipe.hset(keys.replicas(*key), mapping={"desired": decision.replicas, "live": running,
                                                "reason": decision.reason, "at": repr(time.time()),
                                                "zero": decision.zero.value if decision.zero else ""})
        pipe.expire(keys.replicas(*key), DECISION_TTL_S)
    with translate_redis_errors():
        pipe.execute()


def withdraw(gone: Iterable[VersionKey]) -> None:
    """Remove the series `publish` set for versions no longer scaled (retired, or no workers
    allowed): a gauge otherwise exports its last value until the process ends."""
    for key in gone:
        DESIRED_REPLICAS.remove(*key)
        LIVE_REPLICAS.remove(*key)
        for lane in LANES:
            STREAM_LAG.remove(*key, lane)
