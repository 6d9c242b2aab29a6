"""Batch planners over a list of texts (index lists into it), the token lengths they plan by, and
the padding a plan costs."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Sequence


def token_lengths(texts: Sequence[str]) -> list[int]:
    """Real MiniLM token counts ([CLS]/[SEP] included, truncated like the encoder), without torch."""
    from tokenizers import Tokenizer

    from sluice.artifacts import MINILM_URI, resolve_artifact

    model_dir = resolve_artifact(MINILM_URI)
    limit = 256
    with contextlib.suppress(OSError, ValueError, KeyError):
        limit = int(json.loads((model_dir / "sentence_bert_config.json").read_text())["max_seq_length"])
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=limit)
    return [len(e.ids) for e in tokenizer.encode_batch(list(texts))]



def arrival_batches(n: int, size: int) -> list[list[int]]:
    return [list(range(i, min(n, i + size))) for i in range(0, n, size)]


def sorted_batches(lengths: Sequence[int], size: int) -> list[list[int]]:
    """Sort by token length (stable), then chunk: the least padding any batch size-`size` plan gets."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[i : i + size] for i in range(0, len(order), size)]


def bucketed_batches(costs: Sequence[int], size: int, *, max_wait_ms: float = 10.0) -> list[list[int]]:
    """The platform's own policy: sluice.batcher.MicroBatcher's default length buckets, top-up
    off (as the worker builds it), every item present at once (arrival order = index order),
    batches taken one at a time as the worker's runner does."""
    from sluice.batcher import Item, MicroBatcher

    batcher = MicroBatcher(max_batch_size=size, max_wait_ms=max_wait_ms, isolate_tenants=False, top_up=False)
    for i, cost in enumerate(costs):
        batcher.add(Item(id=str(i), tenant="t", cost=int(cost), enqueued_at=i * 1e-6))
    batches = []
    while (batch := batcher.take(math.inf)) is not None:
        batches.append([int(item.id) for item in batch.items])
    return batches


def padding_ratio(lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> float:
    """Padded tokens / real tokens: each batch is padded to its longest member."""
    padded = sum(max(lengths[i] for i in b) * len(b) for b in batches)
    real = sum(lengths[i] for b in batches for i in b)
    return padded / real
