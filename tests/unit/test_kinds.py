"""Input schemas per model kind (sluice.kinds.validate_input) and the token cost hint."""

from __future__ import annotations

from typing import Any

import pytest

from sluice.errors import InvalidInput
from sluice.kinds import ModelKind, check_declared_schema, schema_text, token_estimate, validate_input

TEXT_KINDS = [ModelKind.embedding, ModelKind.classifier]
LIMIT = 100


def check(kind: ModelKind, payload: Any) -> tuple[dict[str, Any], int]:
    return validate_input(kind, payload, max_text_chars=LIMIT)


@pytest.mark.parametrize("kind", TEXT_KINDS)
def test_text_kinds_accept_text_and_answer_its_cost(kind: ModelKind) -> None:
    canonical, cost = check(kind, {"text": "Where is my order?"})
    assert canonical == {"text": "Where is my order?"}
    assert cost == token_estimate("Where is my order?")


@pytest.mark.parametrize("kind", TEXT_KINDS)
@pytest.mark.parametrize("payload, fragment", [
    ("just a string", "JSON object"),
    (["a", "list"], "JSON object"),
    (None, "JSON object"),
    ({}, "text"),
    ({"text": 5}, "text"),
    ({"text": b"bytes"}, "text"),
    ({"text": ["a"]}, "text"),
    ({"text": ""}, "text"),
    ({"text": "   \n"}, "blank"),
    ({"text": "ok", "extra": 1}, "extra"),
    ({"tokens": 5}, "text"),
    ({"text": "x" * (LIMIT + 1)}, str(LIMIT)),
], ids=["string", "list", "null", "empty", "int-text", "bytes-text", "list-text", "empty-text",
        "blank-text", "extra-field", "tokens-not-allowed", "too-long"])
def test_text_kinds_refuse_bad_inputs(kind: ModelKind, payload: Any, fragment: str) -> None:
    with pytest.raises(InvalidInput) as raised:
        check(kind, payload)
    assert raised.value.status == 422
    assert fragment in raised.value.message


def test_text_at_the_limit_is_accepted() -> None:
    canonical, _ = check(ModelKind.embedding, {"text": "x" * LIMIT})
    assert len(canonical["text"]) == LIMIT


def test_synthetic_accepts_text_or_tokens() -> None:
    assert check(ModelKind.synthetic, {"text": "a b c"}) == ({"text": "a b c"}, token_estimate("a b c"))
    assert check(ModelKind.synthetic, {"tokens": 0}) == ({"tokens": 0}, 0)
    assert check(ModelKind.synthetic, {"tokens": 512}) == ({"tokens": 512}, 512)
    # The poison text is valid input: it is the model that fails on it.
    assert check(ModelKind.synthetic, {"text": "__poison__"})[0] == {"text": "__poison__"}


def test_synthetic_drops_an_explicit_null_for_the_other_field() -> None:
    assert check(ModelKind.synthetic, {"text": "hi", "tokens": None}) == ({"text": "hi"}, token_estimate("hi"))


@pytest.mark.parametrize("payload", [
    {},
    {"text": "a", "tokens": 3},
    {"text": None, "tokens": None},
    {"tokens": -1},
    {"tokens": 100_001},
    {"tokens": "12"},
    {"tokens": 1.5},
    {"tokens": True},
    {"text": ""},
    {"text": "  "},
    {"text": "x" * (LIMIT + 1)},
    {"text": "a", "other": 1},
], ids=["empty", "both", "both-null", "negative", "too-many", "str-tokens", "float-tokens", "bool-tokens",
        "empty-text", "blank-text", "too-long", "extra-field"])
def test_synthetic_refuses_bad_inputs(payload: dict[str, Any]) -> None:
    with pytest.raises(InvalidInput):
        check(ModelKind.synthetic, payload)


def test_the_message_names_the_offending_field() -> None:
    with pytest.raises(InvalidInput) as raised:
        check(ModelKind.embedding, {"text": 5})
    assert raised.value.message.startswith("input.text")


def test_token_estimate_counts_specials_words_and_punctuation() -> None:
    assert token_estimate("") == 2  # [CLS] and [SEP]
    assert token_estimate("hello") == 3
    assert token_estimate("hello, world!") == 6
    assert token_estimate("a" * 16) == 2 + 1 + 2  # long words cost more pieces


def test_token_estimate_is_monotone_in_length() -> None:
    words = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog"]
    costs = [token_estimate(" ".join(words[:n])) for n in range(len(words) + 1)]
    assert costs == sorted(costs)
    assert costs[-1] > costs[1]


def test_kinds_are_the_designs_three_and_a_teams_own_four() -> None:
    assert {k.value for k in ModelKind} == {"embedding", "classifier", "synthetic", "hf-embedding", "hf-classifier",
                                            "torch-export", "handler"}
    # The Hugging Face kinds take text like the bundled ones; the other two declare their schemas.
    for kind in (ModelKind.hf_embedding, ModelKind.hf_classifier):
        assert validate_input(kind, {"text": "hello there"}, max_text_chars=LIMIT)[0] == {"text": "hello there"}
        with pytest.raises(InvalidInput):
            validate_input(kind, {"txt": "hello"}, max_text_chars=LIMIT)


@pytest.mark.parametrize(("schema", "message"), [
    ([], "must be a JSON Schema object"),
    ({"type": "array"}, "must describe a JSON object"),
    ({"type": "object", "properties": {"a": {"pattern": "("}}}, "not a valid JSON Schema"),
    ({"type": "object", "$ref": "https://example.com/schema.json"}, "does not resolve within the schema"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/gone"}}}, "does not resolve within the schema"),
])
def test_a_declared_schema_is_refused_unless_it_is_a_self_contained_object_schema(schema: Any, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        check_declared_schema(schema, what="input_schema")


def test_a_declared_schema_may_refer_to_its_own_definitions() -> None:
    schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/word"}}, "required": ["a"],
              "$defs": {"word": {"type": "string", "maxLength": 5}}}
    text = schema_text(check_declared_schema(schema, what="input_schema"))
    assert validate_input(ModelKind.handler, {"a": "short"}, max_text_chars=LIMIT, schema=text) == ({"a": "short"}, 1)
    with pytest.raises(InvalidInput, match=r"input\.a: does not satisfy the version's schema \(maxLength: 5\)"):
        validate_input(ModelKind.handler, {"a": "much too long"}, max_text_chars=LIMIT, schema=text)
