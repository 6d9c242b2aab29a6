"""Model kinds: the input schema each kind accepts and the cost hint the batcher groups by.

The API validates every input here before anything is queued, so a worker never sees an input
its handler cannot take. The cost hint approximates the WordPiece token count without loading a
tokenizer (the API must stay light); the batcher only needs it to be monotone in length.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from sluice.errors import InvalidInput


class ModelKind(StrEnum):
    embedding = "embedding"
    classifier = "classifier"
    synthetic = "synthetic"


class _TextInput(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    text: str = Field(min_length=1)


class _SyntheticInput(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    text: str | None = None
    tokens: int | None = Field(default=None, ge=0, le=100_000)

    @model_validator(mode="after")
    def _exactly_one(self) -> _SyntheticInput:
        if (self.text is None) == (self.tokens is None):
            raise ValueError("give exactly one of 'text' or 'tokens'")
        return self


_SCHEMAS: dict[ModelKind, type[BaseModel]] = {
    ModelKind.embedding: _TextInput,
    ModelKind.classifier: _TextInput,
    ModelKind.synthetic: _SyntheticInput,
}

_WORDPIECE = re.compile(r"\w+|[^\w\s]")


def token_estimate(text: str) -> int:
    # [CLS] + [SEP] + roughly one piece per word or punctuation mark, more for long words.
    pieces = _WORDPIECE.findall(text)
    return 2 + sum(1 + len(p) // 8 for p in pieces)


def validate_input(kind: ModelKind, payload: Any, *, max_text_chars: int) -> tuple[dict[str, Any], int]:
    """Check one input against its kind; answer the canonical input and its cost hint."""
    if not isinstance(payload, dict):
        raise InvalidInput("'input' must be a JSON object")
    try:
        parsed = _SCHEMAS[kind].model_validate(payload)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "input"
        raise InvalidInput(f"input.{where}: {first['msg']}") from None
    canonical = parsed.model_dump(exclude_none=True)
    text = canonical.get("text")
    if text is not None:
        if len(text) > max_text_chars:
            raise InvalidInput(
                f"input.text has {len(text)} characters; the limit is {max_text_chars}"
            )
        if not text.strip():
            raise InvalidInput("input.text must not be blank")
        return canonical, token_estimate(text)
    return canonical, int(canonical["tokens"])
