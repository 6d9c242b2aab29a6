"""The JSON rules of request bodies (api/strict_json.py): what is refused, and that everything
else parses exactly as `json.loads` would."""

from __future__ import annotations

import json
from typing import Any

import pytest

from api.strict_json import MAX_DEPTH, JsonRefused, parse


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize(
    "body",
    [
        rb'{"a": "\ud800"}',
        rb'{"\ud800": 1}',
        rb'["ok", ["\udfff"]]',
        rb'"\udbff\udbff"',
        b'"\xed\xa0\x80"',
        rb'{"a": "\u0000"}',
        rb'{"\u0000": 1}',
        b"NaN",
        b"[Infinity]",
        b'{"a": -Infinity}',
        b"1e999",
        b"[-1e400]",
        b"1" * 4301,
        b'{"a": 1, "a": 1}',
        b'{"a": {"b": 1, "c": 2, "b": 3}}',
        nested(MAX_DEPTH + 1),
        nested(100_000),
        b"\xff",
        b"[1,",
        b"",
    ],
    ids=lambda body: body[:24].decode("latin-1"),
)
def test_refused(body: bytes) -> None:
    with pytest.raises(JsonRefused):
        parse(body)


@pytest.mark.parametrize(
    "body",
    [
        rb'{"a": "\ud83d\ude00", "\u00e9": ["\u65e5", 1.5e308, -0.0, 12345678901234567890]}',
        b"1" * 4300,
        nested(MAX_DEPTH),
        b'{"": {"a": [], "b": {}}, "__proto__": null}',
        b"\t[true, false]\n",
        '{"text": "caf\u00e9"}'.encode("utf-16"),
    ],
    ids=lambda body: body[:24].decode("latin-1"),
)
def test_accepted_as_json_loads_reads_it(body: bytes) -> None:
    expected: Any = json.loads(body)
    assert parse(body) == expected


def test_the_message_is_printable_and_says_where() -> None:
    with pytest.raises(JsonRefused) as refused:
        parse(rb'{"inputs": [{"text": "ok"}, {"text": "x\ud800"}]}')
    assert (
        str(refused.value)
        == "body.inputs[1].text: the string holds a lone UTF-16 surrogate, which is not a Unicode character"
    )
    with pytest.raises(JsonRefused) as refused:
        parse(rb'{"m": {"\ud800\u00e9": 1}}')
    assert str(refused.value).startswith("body.m: a key holds a lone UTF-16 surrogate")
    with pytest.raises(JsonRefused) as refused:
        parse(b'{"k' + b"x" * 500 + b'": 1, "k' + b"x" * 500 + b'": 2}')
    assert len(str(refused.value)) < 120
    str(refused.value).encode("ascii")
