"""The cost model of a forward pass that the pass planner uses (`workers.models.minilm.plan_passes`):
a fixed cost per pass, counted in padded tokens' worth, beside the cost of its padded tokens.

The fixed part is the host's and the precision's: in fp32 on one CPU thread a pass costs about 25
to 40 tokens beyond its padded tokens, in bf16 on AMX about 90 (its tokens are three times
cheaper, its fixed work is not), so a planner that keeps fp32's figure splits bf16 batches into
passes too small. Where the start-up calibration measures a precision, it also times a few passes
of these shapes and fits the figure (docs/ARCHITECTURE.md, "Precision per host").
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

# (texts, tokens each): short and medium texts, one alone and several together, under any cap.
SHAPES: tuple[tuple[int, int], ...] = ((1, 16), (16, 16), (1, 64), (4, 64))
# What a fit may answer: a pass is never free, and past this one pass a batch is the plan anyway.
MIN_OVERHEAD_TOKENS = 1
MAX_OVERHEAD_TOKENS = 4096


def fit_overhead_tokens(timings: Mapping[tuple[int, int], Sequence[float]]) -> int | None:
    """A pass's fixed cost in tokens' worth, from timings of passes by shape (texts, width): the
    least-squares line through each shape's median time against its padded tokens, its intercept
    over its slope. None when the timings cannot say (fewer than two sizes, or a slope that is not
    positive): the planner then keeps the figure it has."""
    points = [(texts * width, statistics.median(times)) for (texts, width), times in timings.items() if times]
    if len({tokens for tokens, _ in points}) < 2:
        return None
    mean_x = statistics.fmean(tokens for tokens, _ in points)
    mean_y = statistics.fmean(seconds for _, seconds in points)
    spread = sum((tokens - mean_x) ** 2 for tokens, _ in points)
    slope = sum((tokens - mean_x) * (seconds - mean_y) for tokens, seconds in points) / spread
    if slope <= 0:
        return None
    intercept = mean_y - slope * mean_x
    return max(MIN_OVERHEAD_TOKENS, min(MAX_OVERHEAD_TOKENS, round(intercept / slope)))
