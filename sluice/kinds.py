"""Model kinds: the input schema each kind accepts and the cost hint the batcher groups by.

The API validates every input here before anything is queued, so a worker never sees an input
its handler cannot take. The text kinds fix their schema; a `handler` or `torch-export` version
declares its own as a JSON Schema, recorded at registration. The cost hint approximates the
WordPiece token count without loading a tokenizer (the API must stay light); the batcher only
needs it to be monotone in length. A handler's own `cost` replaces the hint in the worker.
"""

from __future__ import annotations

import functools
import json
import re
from enum import StrEnum
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from referencing import Registry, Resource
from referencing.exceptions import Unresolvable as ReferencingError
from referencing.jsonschema import DRAFT202012

from sluice.errors import InvalidInput


class ModelKind(StrEnum):
    # The bundled MiniLM (hand-written BERT) and the intent head over it.
    embedding = "embedding"
    classifier = "classifier"
    synthetic = "synthetic"
    # A team's own models: Hugging Face directories, torch.export programs, handler classes.
    hf_embedding = "hf-embedding"
    hf_classifier = "hf-classifier"
    torch_export = "torch-export"
    handler = "handler"


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
    ModelKind.hf_embedding: _TextInput,
    ModelKind.hf_classifier: _TextInput,
}

# Kinds whose versions declare their input and output schemas.
SCHEMA_KINDS = frozenset({ModelKind.handler, ModelKind.torch_export})

_WORDPIECE = re.compile(r"\w+|[^\w\s]")


def token_estimate(text: str) -> int:
    # [CLS] + [SEP] + roughly one piece per word or punctuation mark, more for long words.
    pieces = _WORDPIECE.findall(text)
    return 2 + sum(1 + len(p) // 8 for p in pieces)


def validate_input(kind: ModelKind, payload: Any, *, max_text_chars: int,
                   schema: str | None = None) -> tuple[dict[str, Any], int]:
    """Check one input against its kind (or, for a kind in SCHEMA_KINDS, against the version's
    declared JSON Schema, ``schema``, canonical JSON); answer the canonical input and its cost hint."""
    if not isinstance(payload, dict):
        raise InvalidInput("'input' must be a JSON object")
    if kind in SCHEMA_KINDS:
        if schema is not None:
            _check_declared(_validator(schema), payload)
        return payload, 1
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


def schema_text(schema: dict[str, Any]) -> str:
    """A declared schema as the canonical JSON the validators are cached by."""
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))


def check_declared_schema(schema: Any, *, what: str) -> dict[str, Any]:
    """``schema`` if it is a valid JSON Schema (2020-12) for a JSON object; InvalidInput otherwise."""
    if not isinstance(schema, dict):
        raise InvalidInput(f"{what} must be a JSON Schema object")
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        raise InvalidInput(f"{what} is not a valid JSON Schema: {exc.message[:300]}") from None
    if schema.get("type") != "object":
        raise InvalidInput(f'{what} must describe a JSON object ("type": "object")')
    # Every reference must resolve inside the schema: the API never fetches one while validating.
    resolver = Registry().resolver_with_root(Resource.from_contents(schema, default_specification=DRAFT202012))
    for ref in _refs(schema):
        try:
            resolver.lookup(ref)
        except ReferencingError:
            raise InvalidInput(f"{what}: $ref {ref[:100]!r} does not resolve within the schema") from None
    return schema


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node[k] for k in ("$ref", "$dynamicRef") if isinstance(node.get(k), str)]
        return found + [ref for value in node.values() for ref in _refs(value)]
    if isinstance(node, list):
        return [ref for value in node for ref in _refs(value)]
    return []


@functools.lru_cache(maxsize=256)
def _validator(schema: str) -> Draft202012Validator:
    return Draft202012Validator(json.loads(schema))


def _check_declared(validator: Draft202012Validator, payload: dict[str, Any]) -> None:
    error = next(iter(sorted(validator.iter_errors(payload), key=lambda e: list(e.absolute_path))), None)
    if error is None:
        return
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
    # Named by the rule it breaks, never by its value: the message must not echo user data.
    rule = json.dumps(error.validator_value, separators=(",", ":"))
    if len(rule) > 120:
        rule = rule[:117] + "..."
    raise InvalidInput(f"input{where}: does not satisfy the version's schema ({error.validator}: {rule})")
