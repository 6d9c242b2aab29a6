"""A model with a declared cost: lets scheduler and worker tests reason about latency exactly.

Deliberately free of torch so a synthetic worker starts in milliseconds.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from sluice.errors import InferenceError
from sluice.kinds import ModelKind, token_estimate
from workers.models.protocol import ModelHandler

POISON_TEXT = "__poison__"


class SyntheticHandler(ModelHandler):
    """Sleeps ``fixed_s + per_item_s*n + per_token_s*max_tokens*n`` per batch and echoes inputs.

    The ``max_tokens * n`` term models padding: a batch costs as if every item were as long as
    its longest one. Inputs are ``{"text": str}`` (tokens: ``sluice.kinds.token_estimate``) or
    ``{"tokens": int}``. A text equal to ``"__poison__"`` or a negative token count fails the
    whole batch with InferenceError, so callers can exercise bisection.
    """

    kind = ModelKind.synthetic
    length_buckets = True

    @staticmethod
    def passes(inputs: Sequence[Mapping[str, Any]]) -> list[list[int]]:
        """One pass: this cost model pads a batch to its longest input, so the worker groups by length."""
        return [list(range(len(inputs)))]

    def __init__(self, *, fixed_s: float = 0.002, per_item_s: float = 0.0005, per_token_s: float = 0.00002) -> None:
        for name, value in (
            ("fixed_s", fixed_s),
            ("per_item_s", per_item_s),
            ("per_token_s", per_token_s),
        ):
            if not value >= 0.0:
                raise ValueError(f"{name} must be >= 0, got {value!r}")
        self.fixed_s = fixed_s
        self.per_item_s = per_item_s
        self.per_token_s = per_token_s

    @staticmethod
    def tokens_of(item: Mapping[str, Any]) -> int:
        """Token count the cost model charges for one input; raises InferenceError if invalid."""
        if "tokens" in item:
            tokens = item["tokens"]
            if isinstance(tokens, bool) or not isinstance(tokens, int):
                raise InferenceError(f"'tokens' must be an int, got {type(tokens).__name__}")
            if tokens < 0:
                raise InferenceError(f"'tokens' must be >= 0, got {tokens}")
            return tokens
        text = item.get("text")
        if not isinstance(text, str):
            raise InferenceError("synthetic input needs a 'text' str or a 'tokens' int")
        if text == POISON_TEXT:
            raise InferenceError("poison input in batch")
        # The API's own cost hint, so the batcher's length grouping and this cost model agree.
        return token_estimate(text)

    def cost_s(self, inputs: Sequence[Mapping[str, Any]]) -> float:
        """Seconds ``run`` will sleep for this batch."""
        n = len(inputs)
        if n == 0:
            return 0.0
        max_tokens = max(self.tokens_of(item) for item in inputs)
        return self.fixed_s + self.per_item_s * n + self.per_token_s * max_tokens * n

    def warmup(self) -> None:
        """Nothing to warm: no kernels, no caches; sleeping here would only slow startup."""

    def run(self, inputs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        if not inputs:
            return []
        # Validate (and detect poison) before sleeping: a failing batch fails fast, as a real
        # model failing at tokenisation would.
        cost = self.cost_s(inputs)
        time.sleep(cost)
        return [{"echo": dict(item)} for item in inputs]
