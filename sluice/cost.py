"""What a version's jobs cost: the arithmetic behind `/stats`' `cost`, the dashboard and `sluice plan`.

A worker charges each forward pass the seconds it held its model slot (its model time) plus the
seconds the slot sat idle before it: idle capacity is paid for, and the pass that ends an idle
spell is the one charged with it, so over a window each version carries the idle time its own
arrivals left. Those seconds, times the cores (torch threads) and GPUs the slot holds, are the
pass's core-seconds and GPU-seconds; shared equally by its jobs, they travel in each job's sample
(`sluice.wire.samples`), so the figures cover the same window as the rest of `/stats`.

A price of 0 means unknown: a cost that needs it is None (shown as "—"), never a free run.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

SECONDS_PER_HOUR = 3600.0


@dataclass(frozen=True, slots=True)
class Prices:
    """Per hour of one core and of one GPU, in one currency; 0 = not configured."""

    per_core_hour: float = 0.0
    per_gpu_hour: float = 0.0


@dataclass(frozen=True, slots=True)
class PassUsage:
    """What one forward pass used: the tokens its model computed (padded to the pass's longest
    input) and the real ones, and the slot seconds charged to it (model time + idle before it)."""

    padded_tokens: int
    real_tokens: int
    busy_s: float
    idle_s: float
    cores: float
    gpus: float

    @property
    def core_s(self) -> float:
        return (self.busy_s + self.idle_s) * self.cores

    @property
    def gpu_s(self) -> float:
        return (self.busy_s + self.idle_s) * self.gpus


def pass_tokens(lengths: Iterable[int], passes: Iterable[Iterable[int]]) -> tuple[int, int]:
    """(padded, real) tokens of inputs of these lengths run as these passes (index lists): each
    pass is padded to its longest input."""
    sizes = list(lengths)
    padded = real = 0
    for indices in passes:
        members = [sizes[i] for i in indices]
        if members:
            padded += max(members) * len(members)
            real += sum(members)
    return padded, real


def padding_ratio(*, padded_tokens: float, real_tokens: float) -> float | None:
    """Padded ÷ real tokens; None without real tokens."""
    return padded_tokens / real_tokens if real_tokens > 0 else None


def cost_per_1k_jobs(*, core_s: float, gpu_s: float, jobs: int, prices: Prices) -> float | None:
    """The cost of 1,000 jobs at these prices, from the core- and GPU-seconds `jobs` jobs used.

    None when there are no jobs, nothing was measured, or a resource that was used has no price
    (0): half a bill is worse than none."""
    if jobs <= 0 or (core_s <= 0 and gpu_s <= 0):
        return None
    if (core_s > 0 and prices.per_core_hour <= 0) or (gpu_s > 0 and prices.per_gpu_hour <= 0):
        return None
    spent = core_s * prices.per_core_hour / SECONDS_PER_HOUR + gpu_s * prices.per_gpu_hour / SECONDS_PER_HOUR
    return spent / jobs * 1000.0
