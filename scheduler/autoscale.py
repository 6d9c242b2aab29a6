"""How many workers each version needs, from leading signals: pure, clock passed in.

Scaling on utilization reacts after the spike: a pool is busy only once the work is there, and a
new worker is useful only a cold start later. This policy looks at what is coming instead, per
lane of a version:

* the arrival rate and its trend, forecast one cold start ahead (the earliest a worker started
  now can help), plus ``headroom``;
* the backlog (stream lag + delivered but unfinished), drained within ``drain_target_s``;
* the service rate one replica delivers at the batch sizes it actually forms (its heartbeats).

``need`` answers the replicas those call for, with a one-line reason carrying the numbers;
``Stabilizer`` scales up at once and down only after ``stabilization_s`` of lower
recommendations, by at most ``max_step_down`` a decision, so a periodic load does not flap.
Where each replica runs is ``scheduler/placement.py``'s decision: a replica is a worker process
the version is placed on.
The scheduler and the simulator (`scheduler/planning/capacity_sim.py`) run exactly this code.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Literal

Tier = Literal["latency", "batch"]


@dataclass(frozen=True, slots=True)
class LaneLoad:
    """One lane of a version as the streams show it."""

    backlog: int = 0  # entries not finished: undelivered lag plus delivered-but-pending
    arrival_rate: float = 0.0  # jobs/s, smoothed
    trend: float = 0.0  # change of the arrival rate, jobs/s per s


@dataclass(frozen=True, slots=True)
class Rate:
    rate: float  # jobs/s
    trend: float  # jobs/s per s


class RateTracker:
    """Arrival rate and trend from a monotonic count of arrivals (a stream's `entries-added`),
    both smoothed exponentially over `smoothing_s`, so one Poisson burst does not move them far."""

    def __init__(self, *, smoothing_s: float = 10.0) -> None:
        self.smoothing_s = smoothing_s
        self._last: tuple[float, int] | None = None
        self._rate = Rate(0.0, 0.0)

    def observe(self, now: float, arrived: int) -> Rate:
        if self._last is None:
            self._last = (now, arrived)
            return self._rate
        then, before = self._last
        elapsed = now - then
        if elapsed <= 0:
            return self._rate
        self._last = (now, arrived)
        if arrived < before:  # the stream was recreated: its counter started again
            return self._rate
        weight = 1 - math.exp(-elapsed / self.smoothing_s)
        rate = self._rate.rate + weight * ((arrived - before) / elapsed - self._rate.rate)
        trend = self._rate.trend + weight * ((rate - self._rate.rate) / elapsed - self._rate.trend)
        self._rate = Rate(rate, trend)
        return self._rate


@dataclass(frozen=True, slots=True)
class PoolSignals:
    online: LaneLoad
    bulk: LaneLoad
    # Jobs/s one replica serves at the batch sizes it forms (heartbeats); None before any measured.
    service_rate: float | None
    cold_start_s: float | None  # measured start-up of a worker; None before any
    live: int  # replicas running or starting
    ready: int  # of those, serving now
    min_replicas: int
    max_replicas: int


@dataclass(frozen=True, slots=True)
class ScalingPolicy:
    headroom: float = 0.2  # spare capacity on top of the forecast rate
    drain_target_s: float = 30.0  # a backlog should be gone within this
    stabilization_s: float = 300.0  # scale down only after this long of lower recommendations
    max_step_down: int = 1  # replicas removed per decision at most
    default_cold_start_s: float = 10.0  # until a worker has reported its own

    def __post_init__(self) -> None:
        if self.headroom < 0 or self.drain_target_s <= 0 or self.stabilization_s < 0 or self.max_step_down < 1:
            raise ValueError(f"invalid scaling policy {self}")


@dataclass(frozen=True, slots=True)
class Need:
    """Replicas a version needs: per lane (fractional, before clamping) and in all, clamped."""

    online: float
    bulk: float
    replicas: int
    reason: str


def _lane_need(load: LaneLoad, *, rate: float, capacity: float, horizon_s: float,
               policy: ScalingPolicy) -> tuple[float, float, float]:
    """(replicas, forecast rate, backlog by then) this lane calls for at `rate` jobs/s per replica,
    `capacity` jobs/s of the pool as it is being left to it.

    Replicas asked for now serve one cold start later, and until then the backlog grows by what
    the forecast exceeds the pool's capacity: that grown backlog is the one to drain.
    """
    forecast = max(0.0, load.arrival_rate + load.trend * horizon_s)
    backlog = load.backlog + max(0.0, forecast - capacity) * horizon_s
    return forecast * (1 + policy.headroom) / rate + backlog / (rate * policy.drain_target_s), forecast, backlog


def need(signals: PoolSignals, policy: ScalingPolicy) -> Need:
    low, high = signals.min_replicas, max(signals.min_replicas, signals.max_replicas)
    work = signals.online.backlog + signals.bulk.backlog
    if signals.service_rate is None or signals.service_rate <= 0:
        # Nothing measured yet: hold what runs (at least the floor), one more if work waits.
        held = max(low, signals.live)
        replicas = min(high, held + 1 if work and held == signals.live else held)
        return Need(online=float(replicas), bulk=0.0, replicas=replicas,
                    reason=f"service rate not measured yet; backlog {work}: {replicas}")
    horizon = signals.cold_start_s if signals.cold_start_s is not None else policy.default_cold_start_s
    capacity = signals.ready * signals.service_rate
    online, online_rate, online_backlog = _lane_need(signals.online, rate=signals.service_rate, capacity=capacity,
                                                     horizon_s=horizon, policy=policy)
    # The online lane is served first; bulk gets what capacity it leaves.
    bulk, bulk_rate, bulk_backlog = _lane_need(signals.bulk, rate=signals.service_rate,
                                               capacity=max(0.0, capacity - online_rate), horizon_s=horizon,
                                               policy=policy)
    wanted = math.ceil(round(online + bulk, 6))
    replicas = min(high, max(low, wanted))
    clamp = "" if replicas == wanted else f", clamped to [{low}, {high}]"
    reason = (f"online {online_rate:.1f}/s forecast {horizon:.1f}s ahead, backlog {signals.online.backlog} "
              f"({online_backlog:.0f} by then); bulk {bulk_rate:.1f}/s, backlog {signals.bulk.backlog} "
              f"({bulk_backlog:.0f}); {signals.ready} ready at {signals.service_rate:.1f}/s each: "
              f"{online + bulk:.2f} replicas{clamp}")
    return Need(online=online, bulk=bulk, replicas=replicas, reason=reason)


class Stabilizer:
    """Up at once; down only to the highest recommendation of the last `stabilization_s`, and by
    at most `max_step_down` a decision. One per version; `now` is the caller's clock."""

    def __init__(self, *, policy: ScalingPolicy) -> None:
        self.policy = policy
        self._history: deque[tuple[float, int]] = deque()

    def apply(self, now: float, recommended: int, current: int) -> tuple[int, str]:
        self._history.append((now, recommended))
        while self._history and self._history[0][0] < now - self.policy.stabilization_s:
            self._history.popleft()
        if recommended >= current:
            return recommended, ""
        ceiling = max(r for _, r in self._history)
        if ceiling >= current:
            return current, f"; holding {current} (recommended {ceiling} within {self.policy.stabilization_s:.0f}s)"
        target = max(ceiling, current - self.policy.max_step_down)
        return target, f"; down from {current}"
