"""The circuit breaker of one model version: pure, fed a clock value and observed health.

Closed: the version takes traffic. It opens when its recent error rate crosses a threshold
(over enough finished jobs) or when it has had no live worker for a grace period. Open: the
API sends its unpinned traffic to the stable version and refuses pinned callers with a 503
naming it. After `open_s` it turns half-open and lets one probe job through every
`probe_every_s`; the first job of the version to succeed after that closes it again, the
first to fail reopens it. Asking whether it admits a job spends nothing: only a job actually
routed to the version takes the probe slot (`take_probe`), and gives it back if it is not
queued. Outcomes from before the latest state change are ignored, so a closed breaker is not
tripped again by the errors that opened it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum


class BreakerState(StrEnum):
    closed = "closed"
    open = "open"
    half_open = "half_open"


@dataclass(frozen=True, slots=True)
class Health:
    live_workers: int
    outcomes: Sequence[tuple[float, bool]]  # (finished_at, succeeded), any order
    # The scheduler gave the version no workers on purpose (a batch-tier model waiting for slots, a
    # `min_replicas` 0 version asleep or waking, its first worker starting): its jobs queue until
    # it has some, so no worker is not a fault to refuse submissions for.
    scaled_to_zero: bool = False


class CircuitBreaker:
    def __init__(
        self,
        *,
        error_rate: float = 0.5,
        min_samples: int = 20,
        window_s: float = 30.0,
        no_worker_grace_s: float = 30.0,
        open_s: float = 10.0,
        probe_every_s: float = 1.0,
    ) -> None:
        self.error_rate = error_rate
        self.min_samples = min_samples
        self.window_s = window_s
        self.no_worker_grace_s = no_worker_grace_s
        self.open_s = open_s
        self.probe_every_s = probe_every_s
        self.state = BreakerState.closed
        self.reason = ""
        self._since = float("-inf")  # when the current state began
        self._no_workers_since: float | None = None
        self._next_probe = 0.0

    def _enter(self, state: BreakerState, now: float, reason: str = "") -> None:
        self.state, self.reason, self._since = state, reason, now
        self._next_probe = now

    def observe(self, now: float, health: Health) -> BreakerState:
        if health.live_workers > 0 or health.scaled_to_zero:
            self._no_workers_since = None
        elif self._no_workers_since is None:
            self._no_workers_since = now
        starved = self._no_workers_since is not None and now - self._no_workers_since >= self.no_worker_grace_s
        recent = [ok for at, ok in health.outcomes if at >= max(self._since, now - self.window_s)]
        if self.state is BreakerState.closed:
            errors = sum(1 for ok in recent if not ok)
            if starved:
                self._enter(BreakerState.open, now, "no live workers")
            elif len(recent) >= self.min_samples and errors / len(recent) >= self.error_rate:
                self._enter(BreakerState.open, now, f"error rate {errors}/{len(recent)}")
        elif self.state is BreakerState.open:
            if now - self._since >= self.open_s:
                self._enter(BreakerState.half_open, now, self.reason)
        elif starved:
            self._enter(BreakerState.open, now, "no live workers")
        else:
            probes = sorted((at, ok) for at, ok in health.outcomes if at >= self._since)
            if probes:
                ok = probes[0][1]
                self._enter(BreakerState.closed if ok else BreakerState.open, now,
                            "" if ok else "half-open probe failed")
        return self.state

    def admits(self, now: float) -> bool:
        """Whether a job may go to this version now (half-open: whether the probe slot is free)."""
        if self.state is BreakerState.closed:
            return True
        return self.state is BreakerState.half_open and now >= self._next_probe

    def take_probe(self, now: float) -> bool:
        """A job was routed here: when half-open with the slot free, it is the probe and holds the
        slot for `probe_every_s`. Answers whether it took the slot."""
        if self.state is BreakerState.half_open and now >= self._next_probe:
            self._next_probe = now + self.probe_every_s
            return True
        return False

    def return_probe(self, taken_at: float) -> None:
        """The probe taken at `taken_at` was not queued after all: free its slot, unless the state
        moved on or a later probe holds the slot."""
        if self.state is BreakerState.half_open and self._next_probe == taken_at + self.probe_every_s:
            self._next_probe = taken_at
