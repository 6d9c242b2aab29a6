"""MiniLM-backed handlers: sentence embeddings and the intent classifier.

Test hook: a text exactly equal to ``"__poison__"`` makes the whole batch raise
InferenceError. It lets fault-injection tests make a *real* model batch fail (and check that
the worker bisects the batch down to the poisoned item) without corrupting weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from sluice.cost import pass_tokens
from sluice.errors import InferenceError
from sluice.kinds import ModelKind
from workers.models.head import IntentHead
from workers.models.minilm import MiniLMEncoder
from workers.models.precision import PrecisionChoice
from workers.models.protocol import ModelHandler
from workers.models.synthetic import POISON_TEXT

# Short, medium and long inputs, so warmup touches the kernels and allocator sizes that
# differently padded batches will use.
WARMUP_BATCHES: tuple[tuple[str, ...], ...] = (
    ("hi",),
    ("where is my order?", "I would like to speak to a person about my account please") * 4,
    ("please help me understand why my card payment was declined at the store today " * 8,) * 2,
)


def texts_of(inputs: Sequence[Mapping[str, Any]]) -> list[str]:
    """The ``text`` of every input; a malformed or poisoned item fails the batch."""
    texts: list[str] = []
    for i, item in enumerate(inputs):
        text = item.get("text") if isinstance(item, Mapping) else None
        if not isinstance(text, str):
            raise InferenceError(f"input {i} has no 'text' string")
        if text == POISON_TEXT:
            raise InferenceError(f"input {i} is the poison text")
        texts.append(text)
    return texts


def encoder_tokens(encoder: MiniLMEncoder, texts: list[str]) -> tuple[int, int]:
    """(padded, real) tokens `encoder.encode(texts)` computes: its own passes, each padded."""
    lengths = encoder.token_lengths(texts)
    return pass_tokens(lengths, encoder.passes(lengths))


def _encode(encoder: MiniLMEncoder, texts: list[str]) -> torch.Tensor:
    try:
        return encoder.encode(texts)
    except InferenceError:
        raise
    except (RuntimeError, ValueError, TypeError) as exc:
        # Out-of-memory and shape errors surface as RuntimeError; the caller bisects on
        # InferenceError, so every model-side failure must become one.
        raise InferenceError(f"encoder failed on a batch of {len(texts)}: {exc}") from exc


class EmbeddingHandler(ModelHandler):
    """``{"text": str}`` -> ``{"embedding": [float, ...], "dim": 384}`` (unit length)."""

    kind = ModelKind.embedding
    length_buckets = False

    def __init__(self, *, encoder: MiniLMEncoder, precision: PrecisionChoice | None = None) -> None:
        self.encoder = encoder
        self.precision = precision

    def warmup(self) -> None:
        for batch in WARMUP_BATCHES:
            self.encoder.encode(batch)

    def passes(self, inputs: Sequence[Mapping[str, Any]]) -> list[list[int]]:
        return self.encoder.passes(self.encoder.token_lengths(texts_of(inputs)))

    def count_tokens(self, inputs: Sequence[Mapping[str, Any]]) -> tuple[int, int]:
        return encoder_tokens(self.encoder, texts_of(inputs))

    def run(self, inputs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        if not inputs:
            return []
        vectors = _encode(self.encoder, texts_of(inputs))
        dim = int(vectors.shape[1])
        return [{"embedding": row, "dim": dim} for row in vectors.tolist()]


class ClassifierHandler(ModelHandler):
    """``{"text": str}`` -> ``{"label": str, "scores": {label: probability}}``."""

    kind = ModelKind.classifier
    length_buckets = False

    def __init__(self, *, encoder: MiniLMEncoder, head: IntentHead, labels: Sequence[str],
                 precision: PrecisionChoice | None = None) -> None:
        if head.out.out_features != len(labels):
            raise ValueError(f"head has {head.out.out_features} outputs, {len(labels)} labels")
        self.encoder = encoder
        self.precision = precision
        # The head is a few thousand multiply-adds per text: it stays on the CPU in float32
        # next to the pooled vectors, whatever device the encoder uses.
        self.head = head.to(device="cpu", dtype=torch.float32).eval()
        self.labels = list(labels)

    @torch.inference_mode()
    def probabilities(self, texts: list[str]) -> torch.Tensor:
        return torch.softmax(self.head(_encode(self.encoder, texts)), dim=-1)

    def warmup(self) -> None:
        for batch in WARMUP_BATCHES:
            self.probabilities(list(batch))

    def passes(self, inputs: Sequence[Mapping[str, Any]]) -> list[list[int]]:
        return self.encoder.passes(self.encoder.token_lengths(texts_of(inputs)))

    def count_tokens(self, inputs: Sequence[Mapping[str, Any]]) -> tuple[int, int]:
        return encoder_tokens(self.encoder, texts_of(inputs))

    def run(self, inputs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        if not inputs:
            return []
        probs = self.probabilities(texts_of(inputs))
        out: list[dict[str, Any]] = []
        for row in probs.tolist():
            best = max(range(len(row)), key=row.__getitem__)
            out.append(
                {
                    "label": self.labels[best],
                    "scores": {lab: round(p, 6) for lab, p in zip(self.labels, row, strict=True)},
                }
            )
        return out
