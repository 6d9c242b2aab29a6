"""Latency-throughput frontiers of batching configurations: the pure part of `sluice bench frontier`.

A sweep runs one worker replica at every (max_batch_size, max_wait_ms) of a grid. For each batch
size it first measures a capacity (how fast a backlog drains), then, for each wait, offers open-loop
Poisson load at a ladder of fractions of that capacity, lowest first, and stops at the first rung
the replica does not keep up with. The same procedure (`sweep`) drives the real worker
(launch/frontier_run.py) and the simulator (scheduler/planning/frontier_sim.py); only the `probe` and `rung`
callables differ.

The surprising parts:

* A rung "keeps up" when every job finished and the backlog (arrived - finished) did not grow by
  more than `1 - min_ratio` of the offered rate, measured as the least-squares slope of the backlog
  over the phase after its first fifth. A completion count over a short phase cannot say this: jobs
  finish in batches of up to 32 and a few hundred milliseconds late, so it reads a replica that
  keeps up as one that does not.
* The operating points are every rung that kept up, not only each configuration's highest one:
  close to its capacity a configuration's p99 climbs steeply, so the best throughput under a p99
  budget is usually a lower rung of some configuration. The Pareto front and the budget pick are
  taken over those points.
* Percentiles are exact (numpy's type 7) over every job of a rung, however few: a short phase
  makes a p99 close to the rung's maximum, and the rung's job count says how far to trust it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from scheduler.planning.capacity_sim import CostModel

SERIES = ("real", "sim")
# Backlog samples per rung for the growth slope; the phase's first fifth is the warm-in.
_GROWTH_SAMPLES = 64
_WARM_FRACTION = 0.2


# --- arrivals -------------------------------------------------------------------------------------


def poisson_arrivals(rate_rps: float, duration_s: float, seed: int) -> list[float]:
    """Offsets (s) of Poisson arrivals at `rate_rps` within `duration_s`. The same seed gives the
    same pattern at any rate (only stretched), so two series offered different rates still see
    the same bursts."""
    if rate_rps <= 0 or duration_s <= 0:
        raise ValueError(f"rate and duration must be > 0, got {rate_rps} and {duration_s}")
    rng = random.Random(seed)
    out: list[float] = []
    t = rng.expovariate(1.0) / rate_rps
    while t < duration_s:
        out.append(t)
        t += rng.expovariate(1.0) / rate_rps
    return out


def rung_seed(seed: int, rung: int) -> int:
    """The arrivals' seed of the ladder's `rung`-th step, whatever the configuration: every
    configuration (and both series) meets the same bursts and the same texts at that step, so
    what differs between them is the configuration, not the luck of the draw."""
    return seed * 1_000_003 + rung


# --- measuring one rung ---------------------------------------------------------------------------


def latency_summary(latencies_ms: Sequence[float]) -> tuple[float | None, float | None, float | None]:
    """Exact p50, p95, p99 (type 7); None when there is no sample."""
    if not latencies_ms:
        return None, None, None
    data = np.asarray(latencies_ms, dtype=float)
    p50, p95, p99 = (float(np.percentile(data, q, method="linear")) for q in (50, 95, 99))
    return p50, p95, p99


def backlog_growth(arrivals: Sequence[float], finishes: Sequence[float], duration_s: float) -> float:
    """Jobs per second by which arrived-but-unfinished grew over the phase `[0, duration_s]`
    after its warm-in: the least-squares slope of the backlog sampled on a grid."""
    grid = np.linspace(duration_s * _WARM_FRACTION, duration_s, _GROWTH_SAMPLES)
    arrived = np.searchsorted(np.sort(np.asarray(arrivals, dtype=float)), grid, side="right")
    finished = np.searchsorted(np.sort(np.asarray(finishes, dtype=float)), grid, side="right")
    slope = np.polyfit(grid, (arrived - finished).astype(float), 1)[0]
    return float(slope)


def falling_behind(arrivals: Sequence[float], finishes: Sequence[float], duration_s: float, offered_rps: float, *,
                   min_ratio: float) -> bool:
    """Whether the backlog grew by more than `1 - min_ratio` of the offered rate over the phase."""
    return backlog_growth(arrivals, finishes, duration_s) > (1 - min_ratio) * offered_rps


def drain_rate(finishes: Sequence[float]) -> float:
    """Jobs per second a replica finishes a backlog at: the jobs after the first batch over the
    time from the first batch's end to the last's (the first batch's own time is start-up)."""
    ordered = sorted(finishes)
    if len(ordered) < 2 or ordered[-1] <= ordered[0]:
        raise ValueError("a drain rate needs finishes at two different times at least")
    after_first = sum(1 for t in ordered if t > ordered[0])
    return after_first / (ordered[-1] - ordered[0])


@dataclass(frozen=True, slots=True)
class Rung:
    """One open-loop phase of one configuration at one offered rate."""

    offered_rps: float
    jobs: int
    throughput_rps: float
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None
    mean_batch: float
    growth_rps: float
    kept_up: bool

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Rung:
        return cls(**{name: data[name] for name in cls.__slots__})


def measure_rung(*, offered_rps: float, duration_s: float, arrivals: Sequence[float], finishes: Sequence[float],
                 latencies_ms: Sequence[float], batch_sizes: Sequence[int], min_ratio: float = 0.95) -> Rung:
    """A rung from what it measured: arrival and finish offsets (s from the phase start), every
    finished job's latency and every batch's size. Kept up: all finished, backlog not growing."""
    kept_up = len(finishes) >= len(arrivals) and not falling_behind(arrivals, finishes, duration_s, offered_rps,
                                                                     min_ratio=min_ratio)
    done_in_phase = sum(1 for t in finishes if t <= duration_s)
    throughput = (len(arrivals) if kept_up else done_in_phase) / duration_s
    p50, p95, p99 = latency_summary(latencies_ms)
    mean_batch = sum(batch_sizes) / len(batch_sizes) if batch_sizes else 0.0
    return Rung(offered_rps=offered_rps, jobs=len(arrivals), throughput_rps=throughput, p50_ms=p50, p95_ms=p95,
                p99_ms=p99, mean_batch=mean_batch, growth_rps=backlog_growth(arrivals, finishes, duration_s),
                kept_up=kept_up)


# --- configurations and the sweep ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Point:
    """An operating point: a configuration at a rung it kept up with."""

    max_batch_size: int
    max_wait_ms: float
    throughput_rps: float
    p99_ms: float

    @property
    def label(self) -> str:
        return f"batch {self.max_batch_size}, wait {self.max_wait_ms:g} ms"


@dataclass(frozen=True, slots=True)
class ConfigRun:
    max_batch_size: int
    max_wait_ms: float
    capacity_rps: float
    rungs: tuple[Rung, ...]

    @property
    def sustained(self) -> Rung | None:
        """The highest rung kept up with."""
        kept = [rung for rung in self.rungs if rung.kept_up]
        return max(kept, key=lambda rung: rung.offered_rps) if kept else None

    def points(self) -> list[Point]:
        return [Point(self.max_batch_size, self.max_wait_ms, rung.throughput_rps, rung.p99_ms)
                for rung in self.rungs if rung.kept_up and rung.p99_ms is not None]

    def at_budget(self, p99_budget_ms: float) -> Point | None:
        return best_under_budget(self.points(), p99_budget_ms)

    def to_dict(self, p99_budget_ms: float) -> dict[str, Any]:
        sustained = self.sustained
        at_budget = self.at_budget(p99_budget_ms)
        return {
            "max_batch_size": self.max_batch_size, "max_wait_ms": self.max_wait_ms,
            "capacity_rps": self.capacity_rps,
            "sustained": sustained.to_dict() if sustained else None,
            "at_budget": _point_dict(at_budget),
            "rungs": [rung.to_dict() for rung in self.rungs],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ConfigRun:
        return cls(max_batch_size=int(data["max_batch_size"]), max_wait_ms=float(data["max_wait_ms"]),
                   capacity_rps=float(data["capacity_rps"]),
                   rungs=tuple(Rung.from_dict(rung) for rung in data["rungs"]))


def _point_dict(point: Point | None) -> dict[str, Any] | None:
    if point is None:
        return None
    return {"max_batch_size": point.max_batch_size, "max_wait_ms": point.max_wait_ms,
            "throughput_rps": point.throughput_rps, "p99_ms": point.p99_ms}


def pareto_front(points: Iterable[Point]) -> list[Point]:
    """The points no other point beats on both throughput (higher) and p99 (lower), by
    increasing throughput (and so increasing p99)."""
    front: list[Point] = []
    # Highest throughput first; among equal throughputs the lowest p99 first.
    for point in sorted(points, key=lambda p: (-p.throughput_rps, p.p99_ms)):
        if not front or point.p99_ms < front[-1].p99_ms:
            front.append(point)
    return front[::-1]


def best_under_budget(points: Iterable[Point], p99_budget_ms: float) -> Point | None:
    """The highest-throughput point whose p99 is within the budget (the lower p99 on a tie)."""
    eligible = [p for p in points if p.p99_ms <= p99_budget_ms]
    return max(eligible, key=lambda p: (p.throughput_rps, -p.p99_ms)) if eligible else None


@dataclass(frozen=True, slots=True)
class Series:
    """One sweep's results: the real worker's or the simulator's."""

    name: str
    configs: tuple[ConfigRun, ...]

    def points(self) -> list[Point]:
        return [point for config in self.configs for point in config.points()]

    def front(self) -> list[Point]:
        return pareto_front(self.points())

    def best(self, p99_budget_ms: float) -> Point | None:
        return best_under_budget(self.points(), p99_budget_ms)

    def to_dict(self, p99_budget_ms: float) -> dict[str, Any]:
        return {
            "configs": [config.to_dict(p99_budget_ms) for config in self.configs],
            "front": [_point_dict(point) for point in self.front()],
            "best": _point_dict(self.best(p99_budget_ms)),
        }

    @classmethod
    def from_dict(cls, name: str, data: Mapping[str, Any]) -> Series:
        return cls(name=name, configs=tuple(ConfigRun.from_dict(config) for config in data["configs"]))


def load_series(document: Mapping[str, Any], name: str) -> Series:
    """One series of a frontier.json document (see `launch/frontier_run.py`)."""
    series = document.get("series", {})
    if name not in series:
        raise ValueError(f"the frontier has no {name!r} series (it has: {', '.join(series) or 'none'})")
    return Series.from_dict(name, series[name])


ProbeFn = Callable[[int], float]
RungFn = Callable[[int, float, float, int], Rung]  # (max_batch_size, max_wait_ms, rate, seed) -> Rung


def sweep(name: str, *, batch_sizes: Sequence[int], waits_ms: Sequence[float], fractions: Sequence[float],
          seed: int, probe: ProbeFn, rung: RungFn,
          on_rung: Callable[[int, float, Rung], None] | None = None) -> Series:
    """Probe each batch size's capacity once (a backlog drains the same whatever the wait), then
    climb the ladder of fractions of it for each wait, up to the first rung not kept up with.
    `rung` gets the arrivals' seed: `rung_seed(seed, step)`."""
    if not fractions or any(not f > 0 for f in fractions):
        raise ValueError(f"fractions must be > 0, got {list(fractions)}")
    configs: list[ConfigRun] = []
    for max_batch_size in batch_sizes:
        capacity = probe(max_batch_size)
        for max_wait_ms in waits_ms:
            rungs: list[Rung] = []
            for index, fraction in enumerate(sorted(fractions)):
                result = rung(max_batch_size, max_wait_ms, fraction * capacity, rung_seed(seed, index))
                rungs.append(result)
                if on_rung is not None:
                    on_rung(max_batch_size, max_wait_ms, result)
                if not result.kept_up:
                    break
            configs.append(ConfigRun(max_batch_size, max_wait_ms, capacity, tuple(rungs)))
    return Series(name=name, configs=tuple(configs))


# --- calibrating the simulator's cost model -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CostFit:
    """`CostModel` fitted to measured forward passes, and how well it fits them."""

    cost: CostModel
    batches: int
    r2: float
    median_abs_error: float  # relative, over the measured passes

    def to_dict(self) -> dict[str, Any]:
        return {"fixed_s": self.cost.fixed_s, "per_item_s": self.cost.per_item_s,
                "per_token_s": self.cost.per_token_s, "batches": self.batches, "r2": self.r2,
                "median_abs_error": self.median_abs_error}

    def describe(self) -> str:
        return (f"{self.cost.fixed_s * 1000:.2f} ms + {self.cost.per_item_s * 1000:.3f} ms/job + "
                f"{self.cost.per_token_s * 1e6:.1f} us/padded token")


def fit_cost(batches: Sequence[tuple[int, int, float]]) -> CostFit:
    """Least squares, no coefficient below zero, of `seconds = fixed + n * (per_item + per_token
    * longest)` over measured passes `(n, longest tokens, seconds)`: the synthetic handler's
    cost, so the simulator runs what the real worker measured."""
    from scipy.optimize import nnls

    if len(batches) < 3:
        raise ValueError(f"a cost fit needs 3 batches at least, got {len(batches)}")
    n = np.asarray([b[0] for b in batches], dtype=float)
    longest = np.asarray([b[1] for b in batches], dtype=float)
    seconds = np.asarray([b[2] for b in batches], dtype=float)
    design = np.column_stack([np.ones_like(n), n, n * longest])
    coefficients, _ = nnls(design, seconds)
    predicted = design @ coefficients
    total = float(((seconds - seconds.mean()) ** 2).sum())
    r2 = 1 - float(((seconds - predicted) ** 2).sum()) / total if total > 0 else 1.0
    relative = np.abs(predicted - seconds) / np.maximum(seconds, 1e-9)
    fixed, per_item, per_token = (float(c) for c in coefficients)
    return CostFit(cost=CostModel(fixed_s=fixed, per_item_s=per_item, per_token_s=per_token, cold_start_s=0.0),
                   batches=len(batches), r2=r2, median_abs_error=float(np.median(relative)))
