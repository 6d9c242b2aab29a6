"""A rollout's policy: its steps, soak, sample bars, alpha and margins, checked once at start.

The policy is chosen where a rollout starts (the API) and obeyed where it is decided
(`scheduler.guardrails`); it is stored with the rollout as `to_dict()` and read back with
`from_dict`, so both sides must agree on one definition, and it lives in the kernel.

What would surprise a reader: `alpha_per_test` depends only on the steps, never on the data.
Alpha is split over the fixed family of tests a phase can run (`TESTS_PER_PHASE`), not over the
tests that happen to have enough samples at a look, so the split is decided before any data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from sluice.errors import InvalidPolicy
from sluice.quality import LOW_CONFIDENCE_P

# The tests a phase can run (latency is not compared in the shadow phase, whose copies wait in
# the bulk lane; agreement only exists there).
STEP_TESTS = ("error_rate", "latency", "top_p", "low_confidence", "label_shift")
SHADOW_TESTS = ("error_rate", "top_p", "low_confidence", "label_shift", "agreement")
TESTS_PER_PHASE = max(len(STEP_TESTS), len(SHADOW_TESTS))


@dataclass(frozen=True, slots=True)
class Policy:
    steps: tuple[float, ...] = (1.0, 5.0, 25.0, 100.0)
    soak_s: float = 300.0
    min_samples: int = 200
    # Tests start earlier than promotion may, so a gross regression is caught on little traffic.
    min_test_samples: int = 50
    look_interval_s: float = 10.0
    alpha: float = 0.05
    error_margin: float = 0.02  # absolute error-rate increase
    latency_margin: float = 0.20  # relative increase of the median total latency
    top_p_margin: float = 0.05  # absolute drop of the mean top probability
    low_confidence_threshold: float = LOW_CONFIDENCE_P  # the one /stats reports the rate for
    low_confidence_margin: float = 0.05  # absolute increase of the low-confidence rate
    label_tvd_margin: float = 0.10  # total-variation distance between label distributions
    min_agreement: float = 0.90  # lower confidence bound of agreement needed for shadow -> canary
    hard_error_rate: float = 0.5
    hard_min_requests: int = 10
    worker_grace_s: float = 60.0  # how long after the start a canary may have no live worker

    def __post_init__(self) -> None:
        steps = tuple(float(s) for s in self.steps)
        object.__setattr__(self, "steps", steps)
        if len(steps) < 2 or steps[-1] != 100.0 or any(not 0 < s <= 100 for s in steps):
            raise InvalidPolicy("steps must be at least two percentages in (0, 100] ending at 100")
        if any(b <= a for a, b in zip(steps, steps[1:], strict=False)):
            raise InvalidPolicy("steps must increase")
        if not 0 < self.alpha < 1:
            raise InvalidPolicy("alpha must be in (0, 1)")
        if self.soak_s < 0 or self.look_interval_s <= 0 or self.worker_grace_s < 0:
            raise InvalidPolicy("soak_s and worker_grace_s must be >= 0 and look_interval_s > 0")
        if not 1 <= self.min_test_samples <= self.min_samples:
            raise InvalidPolicy("min_test_samples must be in [1, min_samples]")
        if not 0 <= self.min_agreement <= 1 or not 0 < self.hard_error_rate <= 1:
            raise InvalidPolicy("min_agreement must be in [0, 1] and hard_error_rate in (0, 1]")

    @classmethod
    def chosen(cls, *, steps: Sequence[float] | None = None, soak_s: float | None = None,
               min_samples: int | None = None) -> Policy:
        """The default policy with an operator's choices. A `min_samples` below the default
        `min_test_samples` lowers that too: asking for fewer samples per step is no contradiction."""
        overrides: dict[str, Any] = {}
        if steps is not None:
            overrides["steps"] = tuple(steps)
        if soak_s is not None:
            overrides["soak_s"] = soak_s
        if min_samples is not None:
            overrides["min_samples"] = min_samples
            overrides["min_test_samples"] = min(cls().min_test_samples, min_samples)
        return cls(**overrides)

    @property
    def phases(self) -> int:
        """The phases a rollout can be looked at in: each step below 100 % and a shadow phase.
        Each starts a fresh window, and so fresh tests."""
        return len(self.steps)

    @property
    def alpha_per_test(self) -> float:
        return self.alpha / (TESTS_PER_PHASE * self.phases)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["steps"] = list(self.steps)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Policy:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise InvalidPolicy(f"unknown policy fields: {', '.join(sorted(unknown))}")
        values = dict(data)
        if "steps" in values:
            values["steps"] = tuple(values["steps"])
        return cls(**values)
