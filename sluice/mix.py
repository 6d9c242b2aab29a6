"""The served mix: how many inputs of each cost a version's lane was given, in fixed buckets.

An input's cost is the batcher's (tokens for the text kinds, a handler class's own `cost`
otherwise), so the mix says what a batch pays for and nothing of what the input said. The buckets
are powers of two up to `COST_BOUNDS[-1]`, plus one for anything longer: the same bounds serve the
workers' Prometheus histogram (`sluice_input_cost`), the counts they flush to Redis, the daily
aggregates in the registry and the tuning job that simulates a mix.

The surprising part: a mix compares by its shape, not its size. `drift` is the total-variation
distance of the two distributions (0: the same shares, 1: nothing in common), so a version that
served ten times the traffic of the same texts has not drifted.
"""

from __future__ import annotations

import random
from bisect import bisect_left
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

# Upper bounds (inclusive) of the cost buckets; the last bucket holds every cost above them.
COST_BOUNDS: tuple[int, ...] = tuple(2 ** i for i in range(13))  # 1 .. 4096
OVERFLOW = "inf"
BUCKET_LABELS: tuple[str, ...] = (*(str(bound) for bound in COST_BOUNDS), OVERFLOW)


def bucket_of(cost: int) -> int:
    """The index of the bucket an input of `cost` counts in (a cost under 1 counts as 1)."""
    return bisect_left(COST_BOUNDS, max(1, cost))


def bucket_range(index: int) -> tuple[int, int]:
    """The costs (lowest, highest) a bucket stands for; the overflow bucket is read as up to
    twice the last bound, which is as far as a simulated mix needs to go."""
    low = 1 if index == 0 else COST_BOUNDS[index - 1] + 1
    high = COST_BOUNDS[index] if index < len(COST_BOUNDS) else 2 * COST_BOUNDS[-1]
    return low, high


@dataclass(frozen=True, slots=True)
class Mix:
    """Input counts per cost bucket, in `BUCKET_LABELS` order."""

    counts: tuple[int, ...] = (0,) * len(BUCKET_LABELS)

    def __post_init__(self) -> None:
        if len(self.counts) != len(BUCKET_LABELS) or any(count < 0 for count in self.counts):
            raise ValueError(f"a mix has {len(BUCKET_LABELS)} counts, none negative; got {self.counts}")

    @classmethod
    def of_costs(cls, costs: Iterable[int]) -> Mix:
        counts = [0] * len(BUCKET_LABELS)
        for cost in costs:
            counts[bucket_of(cost)] += 1
        return cls(tuple(counts))

    @classmethod
    def from_mapping(cls, data: Mapping[str, int]) -> Mix:
        """From `to_mapping`'s shape; unknown labels are refused, missing ones are 0."""
        unknown = set(data) - set(BUCKET_LABELS)
        if unknown:
            raise ValueError(f"unknown cost buckets: {sorted(unknown)}")
        return cls(tuple(int(data.get(label, 0)) for label in BUCKET_LABELS))

    def to_mapping(self) -> dict[str, int]:
        """Bucket label -> count, the empty buckets left out."""
        return {label: count for label, count in zip(BUCKET_LABELS, self.counts, strict=True) if count}

    @property
    def total(self) -> int:
        return sum(self.counts)

    def __add__(self, other: Mix) -> Mix:
        return Mix(tuple(a + b for a, b in zip(self.counts, other.counts, strict=True)))

    def shares(self) -> tuple[float, ...]:
        total = self.total
        if not total:
            raise ValueError("an empty mix has no shares")
        return tuple(count / total for count in self.counts)

    def sample(self, n: int, seed: int) -> list[int]:
        """`n` costs drawn from this mix, deterministic for a seed: a bucket by its share, then a
        cost uniformly within the bucket's range."""
        rng = random.Random(seed)
        indices = rng.choices(range(len(self.counts)), weights=self.counts, k=n)
        return [rng.randint(*bucket_range(index)) for index in indices]


def drift(recorded: Mix, reference: Mix) -> float | None:
    """Total-variation distance between two mixes' shares, in [0, 1]; None where either is empty
    (there is nothing to compare)."""
    if not recorded.total or not reference.total:
        return None
    return 0.5 * sum(abs(a - b) for a, b in zip(recorded.shares(), reference.shares(), strict=True))
