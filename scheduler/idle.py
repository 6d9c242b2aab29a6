"""Scale to zero, for a version that opts in with `min_replicas: 0`: pure, clock passed in.

A version with a floor of zero still has its need computed by `scheduler/autoscale.py`, but a
trickle of jobs would keep that need at one replica, and an exponentially smoothed arrival rate
never quite reaches zero. Whether such a version holds a worker at all is decided here instead, on
plain facts read from its streams, so an operator can predict it:

* **asleep**: nothing queued or running and no arrival for `idle_s`; the version is placed on no
  process. It is still served: a submission is accepted and queued.
* **waking**: a job arrived while it was asleep; it is placed on exactly one process (a floor
  placement, so the budget cannot keep it from waking) while its first worker starts.
* **awake**: a worker the wake started reports ready (not one released with it and still
  draining); the lag policy sizes it from one replica upwards.

One `IdleWatch` per version; the scheduler (`scheduler/scaling.py`) and the capacity simulator
(`scheduler/planning/capacity_sim.py`) run it.
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.vocabulary import ZeroState

__all__ = ["Activity", "IdlePolicy", "IdleWatch", "ZeroDecision", "ZeroState"]


@dataclass(frozen=True, slots=True)
class IdlePolicy:
    idle_s: float = 300.0  # no job queued, running or arriving for this long: release the placement

    def __post_init__(self) -> None:
        if self.idle_s <= 0:
            raise ValueError(f"invalid idle policy {self}")


@dataclass(frozen=True, slots=True)
class Activity:
    """What the version's streams and heartbeats show now."""

    backlog: int  # entries queued or running, both lanes (finished entries are deleted)
    arrived: int  # entries ever added, both lanes: a monotonic count (XINFO STREAM entries-added)
    # The workers serving it now, by name (a Worker's consumer name is never reused): a worker
    # released with the version may still report ready while it drains, and must not count as
    # the one a wake started.
    ready: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class ZeroDecision:
    state: ZeroState
    floor: int  # processes the version is placed on at least: 0 asleep, else 1
    reason: str


class IdleWatch:
    """Tracks one version's last activity and answers its state at each look."""

    def __init__(self, *, policy: IdlePolicy) -> None:
        self.policy = policy
        self._arrived: int | None = None
        self._active_at = 0.0
        self._state = ZeroState.asleep
        self._released: frozenset[str] = frozenset()  # ready when it went to sleep, or since

    def observe(self, now: float, activity: Activity) -> ZeroDecision:
        first = self._arrived is None
        # Any change of the counter is an arrival: one that went down means the stream was deleted
        # and written to again.
        arrived = not first and activity.arrived != self._arrived
        self._arrived = activity.arrived
        fresh = activity.ready - self._released
        if self._state is ZeroState.asleep:
            # Whoever reports ready while it sleeps is a released worker still draining.
            self._released = activity.ready
        if first:
            # A scheduler starting (or the version just registered): nothing running and nothing
            # waiting is already at zero; anything else gets a whole idle period from now.
            if activity.backlog == 0 and not activity.ready:
                return self._decide(ZeroState.asleep, "no job queued or running, no worker: at zero")
            self._active_at = now
            self._state = ZeroState.awake if fresh else ZeroState.waking
        if activity.backlog > 0 or arrived:
            self._active_at = now
            if self._state is ZeroState.asleep:
                what = f"{activity.backlog} queued or running" if activity.backlog else "an arrival"
                return self._decide(ZeroState.waking, f"woken by {what}: placing a worker")
        if self._state is not ZeroState.asleep and now - self._active_at >= self.policy.idle_s:
            self._released = activity.ready
            return self._decide(ZeroState.asleep, f"idle {now - self._active_at:.0f} s (nothing queued, running or "
                                                  f"arriving; idle period {self.policy.idle_s:g} s): scaled to zero")
        if self._state is ZeroState.waking and fresh:
            self._state = ZeroState.awake
        if self._state is ZeroState.asleep:
            return self._decide(ZeroState.asleep, "scaled to zero: a job wakes it")
        if self._state is ZeroState.waking:
            return self._decide(ZeroState.waking, "waking: its first worker is starting")
        return self._decide(ZeroState.awake, f"min_replicas 0, last active {now - self._active_at:.0f} s ago, "
                                             f"released after {self.policy.idle_s:g} s idle")

    def _decide(self, state: ZeroState, reason: str) -> ZeroDecision:
        self._state = state
        return ZeroDecision(state=state, floor=0 if state is ZeroState.asleep else 1, reason=reason)
