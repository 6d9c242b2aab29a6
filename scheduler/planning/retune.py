"""Re-tuning a version's batching on the mix it serves: the pure part of the nightly job
(scheduler/retune.py).

The frontier sweep (`frontier.sweep`) runs in the simulator (`frontier_sim.run_replica`) at the
version's fitted cost, with job costs drawn from its recorded mix, over a grid of
(max_batch_size, max_wait_ms) that always holds the current setting. The proposal is the operating
point with the highest sustained throughput whose simulated p99 meets the budget
(`frontier.best_under_budget`); its gain is that throughput over the current setting's best
within the same budget, both from the same simulated run.

The surprising parts:

* Every configuration meets the same arrivals and the same costs at each rung (`rung_seed`), so
  the gain compares settings, not draws.
* A current setting that meets the budget at no rung has no throughput to compare with: the gain
  is then None, and a proposal that does meet it is always worth applying.
* The simulated replica pads a batch to its longest job within the default length buckets, as the
  worker does for a padding handler; a handler that plans its own forward passes is simulated as
  one that pads, which overstates padding for it (the comparison between settings still holds).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from scheduler.planning.capacity_sim import CostModel
from scheduler.planning.frontier import (
    Rung,
    Series,
    best_under_budget,
    drain_rate,
    measure_rung,
    poisson_arrivals,
    sweep,
)
from scheduler.planning.frontier_sim import SimJob, run_replica
from sluice.mix import Mix

PROBE_BATCHES = 6
PROBE_MIN_JOBS = 128


@dataclass(frozen=True, slots=True)
class Grid:
    """The candidates and the simulated load: each rung offers `phase_s` seconds of Poisson
    arrivals at a fraction of the configuration's capacity."""

    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    waits_ms: tuple[float, ...] = (0.0, 2.0, 5.0, 10.0, 20.0, 50.0)
    fractions: tuple[float, ...] = (0.3, 0.5, 0.7, 0.8, 0.9, 0.95)
    phase_s: float = 10.0
    min_ratio: float = 0.95
    seed: int = 0
    adaptive_wait: bool = True  # as the workers batch (`batch_adaptive_wait`)

    def with_setting(self, max_batch_size: int, max_wait_ms: float) -> Grid:
        """This grid, holding the given setting too."""
        return Grid(batch_sizes=tuple(sorted({*self.batch_sizes, max_batch_size})),
                    waits_ms=tuple(sorted({*self.waits_ms, max_wait_ms})), fractions=self.fractions,
                    phase_s=self.phase_s, min_ratio=self.min_ratio, seed=self.seed,
                    adaptive_wait=self.adaptive_wait)


@dataclass(frozen=True, slots=True)
class Proposal:
    max_batch_size: int
    max_wait_ms: float
    throughput_rps: float
    p99_ms: float
    p99_budget_ms: float
    # The current setting's best within the budget in the same run; None: it never met the budget.
    current_rps: float | None
    planned_at: float
    # What it was planned on: becomes the version's `tuned_on` when applied.
    on: Mapping[str, Any] = field(default_factory=dict)

    @property
    def gain(self) -> float | None:
        """Throughput over the current setting's, minus one (0.25: a quarter more); None where the
        current setting never met the budget."""
        if self.current_rps is None or self.current_rps <= 0:
            return None
        return self.throughput_rps / self.current_rps - 1

    def changes(self, max_batch_size: int, max_wait_ms: float) -> bool:
        return (self.max_batch_size, self.max_wait_ms) != (max_batch_size, max_wait_ms)

    def worth_applying(self, *, max_batch_size: int, max_wait_ms: float, min_gain: float) -> bool:
        """A different setting whose gain is over `min_gain`, or that meets a budget the current
        setting does not."""
        if not self.changes(max_batch_size, max_wait_ms):
            return False
        gain = self.gain
        return gain is None or gain > min_gain

    def to_dict(self) -> dict[str, Any]:
        return {"max_batch_size": self.max_batch_size, "max_wait_ms": self.max_wait_ms,
                "throughput_rps": round(self.throughput_rps, 3), "p99_ms": round(self.p99_ms, 3),
                "p99_budget_ms": self.p99_budget_ms,
                "current_rps": None if self.current_rps is None else round(self.current_rps, 3),
                "gain": None if self.gain is None else round(self.gain, 4), "planned_at": self.planned_at,
                "on": dict(self.on)}


DEFAULT_GRID = Grid()


class _Replica:
    """The sweep's probe and rung over the simulator, with costs drawn from the mix."""

    def __init__(self, *, mix: Mix, cost: CostModel, grid: Grid) -> None:
        self.mix, self.cost, self.grid = mix, cost, grid

    def _jobs(self, arrivals: Sequence[float], seed: int) -> list[SimJob]:
        costs = self.mix.sample(len(arrivals), seed)
        return [SimJob(at=at, cost=c, tokens=c) for at, c in zip(arrivals, costs, strict=True)]

    def probe(self, max_batch_size: int) -> float:
        n = max(PROBE_MIN_JOBS, PROBE_BATCHES * max_batch_size)
        jobs = self._jobs([0.0] * n, self.grid.seed)
        return drain_rate(run_replica(jobs, max_batch_size=max_batch_size, max_wait_ms=0.0, cost=self.cost,
                                      adaptive_wait=self.grid.adaptive_wait).finished)

    def rung(self, max_batch_size: int, max_wait_ms: float, rate: float, seed: int) -> Rung:
        offsets = poisson_arrivals(rate, self.grid.phase_s, seed)
        jobs = self._jobs(offsets, seed)
        outcome = run_replica(jobs, max_batch_size=max_batch_size, max_wait_ms=max_wait_ms, cost=self.cost,
                              adaptive_wait=self.grid.adaptive_wait)
        return measure_rung(offered_rps=rate, duration_s=self.grid.phase_s, arrivals=offsets,
                            finishes=outcome.finished,
                            latencies_ms=[(done - job.at) * 1000 for done, job in zip(outcome.finished, jobs,
                                                                                      strict=True)],
                            batch_sizes=outcome.batch_sizes, min_ratio=self.grid.min_ratio)


def simulate(*, mix: Mix, cost: CostModel, grid: Grid) -> Series:
    """The grid's frontier in the simulator, on `mix` at `cost`."""
    if not mix.total:
        raise ValueError("a sweep needs a mix with inputs in it")
    replica = _Replica(mix=mix, cost=cost, grid=grid)
    return sweep("sim", batch_sizes=grid.batch_sizes, waits_ms=grid.waits_ms, fractions=grid.fractions,
                 seed=grid.seed, probe=replica.probe, rung=replica.rung)


def plan(*, mix: Mix, cost: CostModel, p99_budget_ms: float, max_batch_size: int, max_wait_ms: float,
         now: float, grid: Grid = DEFAULT_GRID, on: Mapping[str, Any] | None = None) -> Proposal | None:
    """The best setting within `p99_budget_ms` on `mix`, beside the current one; None where no
    setting of the grid meets the budget. `now` dates it; `on` says what the mix was (tuned_on)."""
    if p99_budget_ms <= 0:
        raise ValueError(f"a p99 budget must be > 0, got {p99_budget_ms}")
    series = simulate(mix=mix, cost=cost, grid=grid.with_setting(max_batch_size, max_wait_ms))
    best = series.best(p99_budget_ms)
    if best is None:
        return None
    current = next(config for config in series.configs
                   if (config.max_batch_size, config.max_wait_ms) == (max_batch_size, max_wait_ms))
    at_budget = best_under_budget(current.points(), p99_budget_ms)
    return Proposal(max_batch_size=best.max_batch_size, max_wait_ms=best.max_wait_ms,
                    throughput_rps=best.throughput_rps, p99_ms=best.p99_ms, p99_budget_ms=p99_budget_ms,
                    current_rps=at_budget.throughput_rps if at_budget else None, planned_at=now,
                    on=dict(on) if on is not None else {"mix": mix.to_mapping(), "samples": mix.total})
