"""What a forward pass used: its padded and real tokens and the slot seconds charged to it
(sluice/cost.py), for the pass's metrics and its jobs' samples.

The tokens are the handler's own count where it tokenizes (the text kinds, which plan their passes
by real token lengths); for any other handler they are the batcher's costs, the pass padded to its
largest. Counting tokenizes the pass's texts once more, on the event loop after the pass: the
Rust tokenizer's cost, small beside a forward pass on the CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from sluice.batcher import Item
from sluice.cost import PassUsage
from sluice.errors import InferenceError
from workers.models.protocol import ModelHandler
from workers.results import Delivery


def pass_tokens(handler: ModelHandler, items: Sequence[Item[Delivery]]) -> tuple[int, int]:
    """(padded, real) tokens of the items run as one call to the handler."""
    if all(item.payload.input_ref is None for item in items):
        # A malformed input fails alone (bisected); its pass is then counted by the costs.
        with contextlib.suppress(InferenceError):
            counted = handler.count_tokens([item.payload.input for item in items])
            if counted is not None:
                return counted
    costs = [max(1, item.cost) for item in items]
    return max(costs) * len(costs), sum(costs)


def pass_usage(handler: ModelHandler, items: Sequence[Item[Delivery]], *, model_s: float, idle_s: float,
               cores: float, gpus: float) -> PassUsage:
    padded, real = pass_tokens(handler, items)
    return PassUsage(padded_tokens=padded, real_tokens=real, busy_s=model_s, idle_s=idle_s, cores=cores, gpus=gpus)
