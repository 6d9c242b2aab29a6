"""Capacity planning from a frontier: replicas and cost per device type for a peak rate and a p99
budget (`sluice plan`).

Per device, a replica's throughput is that of the frontier's best operating point within the
budget (`scheduler.planning.frontier.best_under_budget`); the replicas are what the peak rate plus headroom
needs of it, rounded up.

A device is given as ``NAME=PRICE[:SOURCE]``: PRICE is what one replica costs per hour (any
currency, the same for every device); SOURCE is a frontier.json measured on that device, or a
speed factor against the base frontier (``2.5`` or ``x2.5``: that device runs the model 2.5 times
as fast). Without SOURCE the base frontier is the device's own. A speed factor scales the whole
frontier in time: throughputs times the factor, latencies divided by it. That is exact for the
model's part and only approximate for the batcher's (``max_wait_ms`` does not shrink), so measure a
frontier on the device when the budget is tight.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scheduler.planning.frontier import Point, Series, best_under_budget

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")
DEVICE_SYNTAX = "NAME=PRICE[:SOURCE], SOURCE a frontier.json path or a speed factor (2.5 or x2.5)"
SECONDS_PER_HOUR = 3600.0


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    name: str
    price_per_hour: float
    frontier: Path | None = None  # measured on this device; None: the base frontier
    speedup: float = 1.0  # against the frontier used


def parse_device(text: str) -> DeviceSpec:
    """``NAME=PRICE[:SOURCE]`` (see the module docstring); ValueError says what is wrong."""
    name, sep, rest = text.partition("=")
    if not sep or not _NAME.fullmatch(name):
        raise ValueError(f"{text!r}: expected {DEVICE_SYNTAX}")
    price_text, _, source = rest.partition(":")
    try:
        price = float(price_text)
    except ValueError:
        raise ValueError(f"{text!r}: price {price_text!r} is not a number ({DEVICE_SYNTAX})") from None
    if not (math.isfinite(price) and price >= 0):
        raise ValueError(f"{text!r}: price must be finite and >= 0")
    if not source:
        return DeviceSpec(name=name, price_per_hour=price)
    factor = _speed_factor(source)
    if factor is None:
        return DeviceSpec(name=name, price_per_hour=price, frontier=Path(source))
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"{text!r}: speed factor must be finite and > 0")
    return DeviceSpec(name=name, price_per_hour=price, speedup=factor)


def _speed_factor(source: str) -> float | None:
    """The factor `source` spells (``2.5``, ``x2.5``), or None when it is a path."""
    try:
        return float(source[1:] if source[:1] in ("x", "X") else source)
    except ValueError:
        return None


def scaled(point: Point, speedup: float) -> Point:
    return Point(point.max_batch_size, point.max_wait_ms, point.throughput_rps * speedup, point.p99_ms / speedup)


@dataclass(frozen=True, slots=True)
class PlanRow:
    device: str
    price_per_hour: float
    speedup: float
    point: Point | None  # the operating point used (scaled); None: nothing meets the budget
    replicas: int | None = None
    cost_per_hour: float | None = None
    cost_per_million_at_peak: float | None = None
    cost_per_million_at_full: float | None = None

    @property
    def per_replica_rps(self) -> float | None:
        return self.point.throughput_rps if self.point else None

    def to_dict(self) -> dict[str, Any]:
        point = self.point
        return {
            "device": self.device, "price_per_hour": self.price_per_hour, "speedup": self.speedup,
            "max_batch_size": point.max_batch_size if point else None,
            "max_wait_ms": point.max_wait_ms if point else None,
            "per_replica_rps": point.throughput_rps if point else None,
            "p99_ms": point.p99_ms if point else None,
            "replicas": self.replicas, "cost_per_hour": self.cost_per_hour,
            "cost_per_million_at_peak": self.cost_per_million_at_peak,
            "cost_per_million_at_full": self.cost_per_million_at_full,
        }


def plan_device(series: Series, device: DeviceSpec, *, p99_budget_ms: float, peak_rps: float,
                headroom: float) -> PlanRow:
    """Replicas = ceil(peak x (1 + headroom) / per-replica throughput at the budget); cost per
    million requests at the peak rate (the replicas' hourly cost over an hour of peak traffic)
    and at full per-replica use (one replica's hourly cost over an hour of its throughput)."""
    if peak_rps <= 0 or headroom < 0 or p99_budget_ms <= 0:
        raise ValueError("peak_rps and p99_budget_ms must be > 0 and headroom >= 0")
    points = [scaled(point, device.speedup) for point in series.points()]
    best = best_under_budget(points, p99_budget_ms)
    if best is None or best.throughput_rps <= 0:
        return PlanRow(device=device.name, price_per_hour=device.price_per_hour, speedup=device.speedup, point=None)
    # The rounding guard: 100 x 1.1 / 10 is 11.000000000000002 in floating point, and 11 replicas do.
    replicas = math.ceil(round(peak_rps * (1 + headroom) / best.throughput_rps, 9))
    cost_per_hour = replicas * device.price_per_hour
    return PlanRow(
        device=device.name, price_per_hour=device.price_per_hour, speedup=device.speedup, point=best,
        replicas=replicas, cost_per_hour=cost_per_hour,
        cost_per_million_at_peak=cost_per_hour / (peak_rps * SECONDS_PER_HOUR) * 1e6,
        cost_per_million_at_full=device.price_per_hour / (best.throughput_rps * SECONDS_PER_HOUR) * 1e6,
    )
