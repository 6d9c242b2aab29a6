"""Autoscaling in simulated time: an arrival trace through the real batcher and the real policy.

A discrete-event simulation of one version's worker pool. Jobs arrive on a trace (`TRACES`),
wait in the real `sluice.batcher.MicroBatcher`, and run on replicas that each take the most
urgent ready batch when free, at the `synthetic` handler's cost (fixed + per item + per padded
token seconds). Every `tick_s` a scaling policy decides how many replicas there should be:

* ``lag``: `scheduler.autoscale` as the scheduler runs it (`need` from backlog, arrival rate and
  trend, measured service rate and cold start; `Stabilizer`), and with `min_replicas` 0 the
  scheduler's `scheduler.idle.IdleWatch` (released after `idle_s` idle, woken by an arrival);
* ``utilization``: what an HPA on CPU would do, every `hpa_period_s`: replicas x measured busy
  share over the last `hpa_window_s` / `target_utilization`, a 10 % tolerance, the same
  stabilization window for scale-down, the same bounds and cold start.

A replica started becomes useful `cold_start_s` later; one removed finishes its batch first
(nothing is lost). Replica-minutes count every replica from its start to its end, cold start
included. The same seed gives the same arrivals for every policy.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any, Literal

import numpy as np

from scheduler.autoscale import LaneLoad, PoolSignals, RateTracker, ScalingPolicy, Stabilizer, need
from scheduler.idle import Activity, IdlePolicy, IdleWatch, ZeroState
from sluice.batcher import Item, MicroBatcher

PolicyName = Literal["lag", "utilization"]
POLICIES: tuple[PolicyName, ...] = ("lag", "utilization")

RateFn = Callable[[float], float]


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    rate: RateFn  # jobs/s at time t
    horizon_s: float


def _spike(base: float) -> RateFn:
    return lambda t: base * 10 if 600 <= t < 780 else base


def _periodic(base: float) -> RateFn:
    return lambda t: base * 4 if t % 180 < 30 else base


def _diurnal(base: float) -> RateFn:
    return lambda t: base * (1 + 0.8 * math.sin(2 * math.pi * t / 1800))


def traces(base: float = 40.0) -> dict[str, Trace]:
    """`steady`; `diurnal` (a day compressed to 30 min, +-80 %); `spike` (10x for 3 min at 10
    min); `periodic` (4x for 30 s every 3 min)."""
    return {
        "steady": Trace("steady", lambda t: base, 1800.0),
        "diurnal": Trace("diurnal", _diurnal(base), 3600.0),
        "spike": Trace("spike", _spike(base), 1800.0),
        "periodic": Trace("periodic", _periodic(base), 1800.0),
    }


@dataclass(frozen=True, slots=True)
class CostModel:
    """The synthetic handler's cost: a batch of n items whose longest has L tokens takes
    fixed_s + n * (per_item_s + per_token_s * L)."""

    fixed_s: float = 0.010
    per_item_s: float = 0.004
    per_token_s: float = 0.00005
    cold_start_s: float = 20.0

    def batch_s(self, n: int, max_tokens: int) -> float:
        return self.fixed_s + n * (self.per_item_s + self.per_token_s * max_tokens)


@dataclass(frozen=True, slots=True)
class SimConfig:
    min_replicas: int = 1
    max_replicas: int = 16
    max_batch_size: int = 32
    max_wait_ms: float = 10.0
    tick_s: float = 2.0
    hpa_period_s: float = 15.0
    hpa_window_s: float = 30.0
    target_utilization: float = 0.7
    idle_s: float = 300.0  # min_replicas 0: released after this long idle (scheduler/idle.py)
    seed: int = 0


@dataclass
class _Replica:
    started_at: float
    ready_at: float
    busy_until: float | None = None  # None: idle
    draining: bool = False
    ended_at: float | None = None


@dataclass
class SimResult:
    policy: PolicyName
    trace: str
    jobs: int
    p50_ms: float
    p95_ms: float
    p99_ms: float
    replica_minutes: float
    scale_changes: int
    max_replicas: int
    timeline: list[tuple[float, float, int, float]] = field(repr=False)  # (t, arrivals/s, replicas, p99 ms)

    def line(self) -> dict[str, Any]:
        return {"policy": self.policy, "trace": self.trace, "jobs": self.jobs, "p50_ms": round(self.p50_ms, 1),
                "p95_ms": round(self.p95_ms, 1), "p99_ms": round(self.p99_ms, 1),
                "replica_minutes": round(self.replica_minutes, 2), "scale_changes": self.scale_changes,
                "max_replicas": self.max_replicas}


def arrivals(trace: Trace, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Arrival times (sorted) and token lengths: Poisson per second at the trace's rate; 80 %
    short (10-30 tokens), 20 % long (100-250), like the benches' skewed mix."""
    rng = np.random.default_rng(seed)
    seconds = np.arange(int(trace.horizon_s))
    counts = rng.poisson([trace.rate(float(s)) for s in seconds])
    times = np.sort(np.repeat(seconds, counts) + rng.random(int(counts.sum())))
    long = rng.random(len(times)) < 0.2
    tokens = np.where(long, rng.integers(100, 251, len(times)), rng.integers(10, 31, len(times)))
    return times, tokens


class _Simulation:
    def __init__(self, *, trace: Trace, policy: PolicyName, cost: CostModel, config: SimConfig,
                 scaling: ScalingPolicy) -> None:
        self.trace, self.policy_name, self.cost, self.config, self.scaling = trace, policy, cost, config, scaling
        self.batcher: MicroBatcher[None] = MicroBatcher(max_batch_size=config.max_batch_size,
                                                        max_wait_ms=config.max_wait_ms, isolate_tenants=False)
        self.replicas: list[_Replica] = []
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = count()
        self.latencies: list[float] = []
        self.finished_at: list[float] = []
        self.desired = config.min_replicas
        self.peak = 0
        self.changes = 0
        self.stabilizer = Stabilizer(policy=scaling)
        self.tracker = RateTracker()
        self.idle = IdleWatch(policy=IdlePolicy(idle_s=config.idle_s)) if config.min_replicas == 0 else None
        self.arrived = 0
        self.in_service = 0
        self.busy_log: list[tuple[float, float]] = []  # (start, end) of every batch
        self.served: list[tuple[int, float]] = []  # (items, seconds) of recent batches
        self.wake_at: float | None = None
        self.timeline: list[tuple[float, float, int, float]] = []

    def push(self, at: float, kind: str, data: Any = None) -> None:
        heapq.heappush(self.events, (at, next(self.seq), kind, data))

    # --- the pool --------------------------------------------------------------------------------

    def active(self) -> list[_Replica]:
        return [r for r in self.replicas if r.ended_at is None and not r.draining]

    def scale_to(self, now: float, target: int) -> None:
        if target != self.desired:
            self.changes += 1
            self.desired = target
        self.peak = max(self.peak, target)
        active = self.active()
        for _ in range(target - len(active)):
            replica = _Replica(started_at=now, ready_at=now + self.cost.cold_start_s)
            self.replicas.append(replica)
            self.push(replica.ready_at, "ready", replica)
        # Remove the youngest first: one still starting costs nothing to drop; a busy one drains.
        for replica in sorted(active, key=lambda r: -r.started_at)[: max(0, len(active) - target)]:
            if replica.busy_until is None:
                replica.ended_at = now
            else:
                replica.draining = True

    def dispatch(self, now: float) -> None:
        for replica in self.active():
            if replica.ready_at > now or replica.busy_until is not None:
                continue
            batch = self.batcher.take(now)
            if batch is None:
                break
            duration = self.cost.batch_s(len(batch.items), batch.max_cost)
            replica.busy_until = now + duration
            self.in_service += len(batch.items)
            self.busy_log.append((now, now + duration))
            self.served.append((len(batch.items), duration))
            self.push(now + duration, "done", (replica, batch))
        deadline = self.batcher.next_deadline()
        if deadline is not None and deadline > now and (self.wake_at is None or self.wake_at <= now):
            self.wake_at = deadline
            self.push(deadline, "wake")

    # --- the policies ------------------------------------------------------------------------------

    def service_rate(self) -> float | None:
        recent = self.served[-64:]
        busy = sum(seconds for _, seconds in recent)
        return sum(n for n, _ in recent) / busy if busy > 0 else None

    def busy_share(self, now: float) -> float:
        since = now - self.config.hpa_window_s
        busy = sum(min(end, now) - max(start, since) for start, end in self.busy_log[-4096:] if end > since)
        ready = sum(min(now, r.ended_at or now) - max(since, r.ready_at) for r in self.replicas
                    if r.ready_at < now and (r.ended_at or now) > since)
        return busy / ready if ready > 0 else 0.0

    def tick(self, now: float) -> None:
        config = self.config
        if self.policy_name == "lag":
            rate = self.tracker.observe(now, self.arrived)
            backlog = len(self.batcher) + self.in_service
            ready = sum(1 for r in self.active() if r.ready_at <= now)
            floor = config.min_replicas
            if self.idle is not None:
                serving = frozenset(str(i) for i, r in enumerate(self.replicas)
                                    if r.ended_at is None and not r.draining and r.ready_at <= now)
                zero = self.idle.observe(now, Activity(backlog=backlog, arrived=self.arrived, ready=serving))
                if zero.state is not ZeroState.awake:
                    # As the scheduler: asleep holds none, waking one until it is ready.
                    self.stabilizer = Stabilizer(policy=self.scaling)
                    self.scale_to(now, zero.floor)
                    self.push(now + config.tick_s, "tick")
                    return
                floor = zero.floor
            signals = PoolSignals(
                online=LaneLoad(backlog=backlog, arrival_rate=rate.rate, trend=rate.trend),
                bulk=LaneLoad(), service_rate=self.service_rate(), cold_start_s=self.cost.cold_start_s,
                live=len(self.active()), ready=ready, min_replicas=floor, max_replicas=config.max_replicas)
            target, _ = self.stabilizer.apply(now, need(signals, self.scaling).replicas, self.desired)
            self.scale_to(now, target)
            self.push(now + config.tick_s, "tick")
            return
        ratio = self.busy_share(now) / config.target_utilization
        recommended = self.desired if abs(ratio - 1) <= 0.1 else math.ceil(self.desired * ratio)
        recommended = min(config.max_replicas, max(config.min_replicas, recommended))
        target, _ = self.stabilizer.apply(now, recommended, self.desired)
        self.scale_to(now, target)
        self.push(now + config.hpa_period_s, "tick")

    # --- the run ----------------------------------------------------------------------------------

    def run(self, times: np.ndarray, tokens: np.ndarray) -> SimResult:
        self.scale_to(0.0, self.config.min_replicas)
        for replica in self.replicas:  # warm at the start, as a pool that has been running
            replica.ready_at = 0.0
        self.push(self.config.tick_s, "tick")
        self.push(60.0, "minute")
        index, total = 0, len(times)
        end = self.trace.horizon_s
        while index < total or self.in_service or len(self.batcher):
            next_arrival = float(times[index]) if index < total else math.inf
            if self.events and self.events[0][0] <= next_arrival:
                now, _, kind, data = heapq.heappop(self.events)
                if kind == "done":
                    self.finish(now, *data)
                elif kind == "tick" and now <= end + 600:
                    self.tick(now)
                elif kind == "minute":
                    self.minute(now)
                self.dispatch(now)
            else:
                now = next_arrival
                self.batcher.add(Item(id=str(index), tenant="t", cost=int(tokens[index]), enqueued_at=now))
                self.arrived += 1
                index += 1
                self.dispatch(now)
        for replica in self.replicas:
            if replica.ended_at is None:
                replica.ended_at = max(end, now)
        return self.result(now)

    def finish(self, now: float, replica: _Replica, batch: Any) -> None:
        replica.busy_until = None
        self.in_service -= len(batch.items)
        for item in batch.items:
            self.latencies.append(now - item.enqueued_at)
            self.finished_at.append(now)
        if replica.draining:
            replica.ended_at = now

    def minute(self, now: float) -> None:
        recent = [lat for lat, at in zip(self.latencies[-20000:], self.finished_at[-20000:], strict=True)
                  if at > now - 60]
        p99 = float(np.percentile(recent, 99) * 1000) if recent else 0.0
        self.timeline.append((now, self.trace.rate(now - 30), len(self.active()), p99))
        if now < self.trace.horizon_s + 600:
            self.push(now + 60.0, "minute")

    def result(self, now: float) -> SimResult:
        latencies = np.asarray(self.latencies) * 1000
        minutes = sum(((r.ended_at or now) - r.started_at) for r in self.replicas) / 60
        p50, p95, p99 = (float(np.percentile(latencies, q)) if len(latencies) else 0.0 for q in (50, 95, 99))
        return SimResult(policy=self.policy_name, trace=self.trace.name, jobs=len(latencies), p50_ms=p50,
                         p95_ms=p95, p99_ms=p99, replica_minutes=minutes, scale_changes=self.changes,
                         max_replicas=self.peak, timeline=self.timeline)


def simulate(trace: Trace, policy: PolicyName, *, cost: CostModel | None = None, config: SimConfig | None = None,
             scaling: ScalingPolicy | None = None) -> SimResult:
    config = config or SimConfig()
    times, tokens = arrivals(trace, config.seed)
    sim = _Simulation(trace=trace, policy=policy, cost=cost or CostModel(), config=config,
                      scaling=scaling or ScalingPolicy())
    return sim.run(times, tokens)


def plot(results: Sequence[SimResult], path: Path) -> Path:
    """Arrivals, replicas and per-minute p99 over time, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    first = results[0].timeline
    axes[0].plot([t / 60 for t, *_ in first], [rate for _, rate, _, _ in first], color="black")
    axes[0].set_ylabel("arrivals /s")
    for result in results:
        minutes = [t / 60 for t, *_ in result.timeline]
        axes[1].step(minutes, [n for _, _, n, _ in result.timeline], where="post", label=result.policy)
        axes[2].plot(minutes, [p99 for *_, p99 in result.timeline], label=result.policy)
    axes[1].set_ylabel("replicas")
    axes[2].set_ylabel("p99 ms (per minute)")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("minutes")
    axes[1].legend()
    fig.suptitle(f"trace {results[0].trace}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
