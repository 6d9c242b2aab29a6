"""How a batch the batcher closed becomes the forward passes a worker runs and stores.

A handler may plan its own passes over a batch (`ModelHandler.passes`, by length): each pass is
stored as soon as it is done, so a short job does not wait for the long ones that shared its batch.
"""

from __future__ import annotations

from collections.abc import Sequence

from sluice.batcher import Batch, Item
from sluice.errors import InferenceError
from workers.models.protocol import ModelHandler
from workers.results import Delivery


def part(batch: Batch[Delivery], items: Sequence[Item[Delivery]]) -> Batch[Delivery]:
    """Some of a batch's items, as a batch of their own (stored apart from the rest)."""
    return Batch(items=tuple(items), close_reason=batch.close_reason, bucket=batch.bucket, tenant=batch.tenant,
                 closed_at=batch.closed_at)


def forward_passes(handler: ModelHandler, batch: Batch[Delivery]) -> list[Batch[Delivery]]:
    """`batch` as the forward passes `handler` plans, the pass holding the oldest job first: the
    tail is made of the jobs that have waited longest."""
    if handler.length_buckets or len(batch.items) == 1 or any(
            item.payload.input_ref is not None for item in batch.items):
        return [batch]
    try:
        plan = handler.passes([item.payload.input for item in batch.items])
    except InferenceError:
        return [batch]  # a malformed input: run_isolating fails it alone
    parts = [part(batch, [batch.items[i] for i in sorted(one)]) for one in plan]
    return sorted(parts, key=lambda one: one.oldest_enqueued_at)
