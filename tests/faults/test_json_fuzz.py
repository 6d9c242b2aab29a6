"""Fuzzing every route that reads a JSON body with raw JSON text: zero 5xx and zero dropped
connections.

schemathesis (test_fuzz.py) draws bodies from the schema, as Python values that its client then
serialises: it never writes a lone surrogate escape, `NaN`, a 5000-digit integer or a duplicate
key, because those are not values but spellings. Here Hypothesis writes the JSON *text* itself:
strings assembled from plain characters, escapes (lone and paired surrogates, `\\u0000`), and raw
surrogate bytes; numbers as digit strings (huge, overflowing, non-finite); keys drawn from the
schema's own property names as well as odd ones, so objects repeat keys and reach past the first
validation; containers nested a few levels or thousands. A body is either the route's own object
with such values in its fields, any such JSON value, a deep nest, or one of those cut short.

The routes are every operation of `/openapi.json` with a request body, path parameters pinned to
things that exist (or not), in two passes like test_fuzz.py: the demo tenant against the
session's API, and an admin against an API of this test's own (a scratch database and a private
Redis), whose registry the fuzzed writes may change at will. Every answer is counted; a 5xx or a
transport error (reset, disconnect, timeout) is collected with the body that caused it, and the
test fails listing them.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from launch.seed import seed
from sluice.registry.store import Registry
from sluice.settings import Settings
from tests.support import ApiServer, http_client, make_settings, register_synthetic_model

from ._support import RedisServer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("batches_ended_after"), pytest.mark.soak]


@dataclass(frozen=True)
class Operation:
    method: str
    path: str
    schema: dict[str, Any]

    @property
    def label(self) -> str:
        return f"{self.method} {self.path}"


@dataclass
class Tally:
    cases: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    server_errors: int = 0
    unroutable: int = 0
    resets: int = 0
    failures: list[str] = field(default_factory=list)

    def record(self, operation: Operation, body: bytes, outcome: httpx.Response | Exception) -> None:
        self.cases += 1
        if isinstance(outcome, Exception):
            self.resets += 1
            self.failures.append(f"{operation.label}: {outcome!r} for {body[:300]!r}")
            return
        self.statuses[outcome.status_code] = self.statuses.get(outcome.status_code, 0) + 1
        if outcome.status_code == 503 and _error_code(outcome) == "no_servable_version":
            # The designed answer (503, no servable version) for a model the fuzzed admin
            # writes created without routing weight; any other 5xx is a failure.
            self.unroutable += 1
        elif outcome.status_code >= 500:
            self.server_errors += 1
            self.failures.append(f"{operation.label}: {outcome.status_code} {outcome.text[:200]!r} for {body[:300]!r}")


def _error_code(response: httpx.Response) -> str | None:
    try:
        return str(response.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return None


# --- the operations, and plausible bodies from their schemas -------------------------------------


def _resolve(spec: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]]
    return schema


def body_operations(spec: dict[str, Any]) -> tuple[list[Operation], set[str]]:
    """Every operation that takes a JSON body, and every property name and enum value of the schema
    (the words that get a fuzzed body past the first validation)."""
    operations = []
    for path, methods in spec["paths"].items():
        for method, operation in methods.items():
            content = operation.get("requestBody", {}).get("content", {})
            if "application/json" in content:
                operations.append(Operation(method.upper(), path, content["application/json"]["schema"]))
    words: set[str] = set()
    for schema in spec["components"]["schemas"].values():
        words.update(schema.get("properties", ()))
        for prop in schema.get("properties", {}).values():
            words.update(str(v) for v in prop.get("enum", ()) if v is not None)
    return operations, words


def plausible(spec: dict[str, Any], schema: dict[str, Any], words: list[str]) -> st.SearchStrategy[Any]:
    """Values that mostly pass the schema, so that a weird spelling put in them reaches the handler.
    Free-form fields (a job's `input`) get a synthetic model's input."""
    schema = _resolve(spec, schema)
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "anyOf" in schema:
        return st.one_of([plausible(spec, option, words) for option in schema["anyOf"]])
    kind = schema.get("type")
    if kind == "string":
        if "{64}" in schema.get("pattern", ""):
            return st.just("0" * 64)
        return st.sampled_from(["http://example.com/hook"] if schema.get("format") == "uri" else words)
    if kind in ("integer", "number"):
        low = max(int(schema.get("minimum", schema.get("exclusiveMinimum", 0))), 0)
        return st.integers(low, max(low, min(int(schema.get("maximum", 50)), 50)))
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        return st.lists(plausible(spec, schema.get("items", {}), words), min_size=1, max_size=3)
    if kind == "object":
        properties = {name: plausible(spec, prop, words) for name, prop in schema.get("properties", {}).items()}
        if properties:
            required = set(schema.get("required", ()))
            return st.fixed_dictionaries(
                {k: v for k, v in properties.items() if k in required},
                optional={k: v for k, v in properties.items() if k not in required},
            )
        extra = schema.get("additionalProperties")
        values = plausible(spec, extra, words) if isinstance(extra, dict) else st.sampled_from(words)
        return st.dictionaries(st.sampled_from(words), values, min_size=1, max_size=3)
    return st.one_of(
        st.fixed_dictionaries({"text": st.sampled_from(words)}), st.fixed_dictionaries({"tokens": st.integers(0, 50)})
    )


# --- JSON text ------------------------------------------------------------------------------------

_ESCAPES = st.one_of(
    st.integers(0xD800, 0xDFFF).map(lambda c: f"\\u{c:04X}" if c % 2 else f"\\u{c:04x}"),  # lone
    st.tuples(st.integers(0xD800, 0xDBFF), st.integers(0xDC00, 0xDFFF)).map(
        lambda p: f"\\u{p[0]:04x}\\u{p[1]:04x}"
    ),  # a valid pair
    st.just("\\u0000"),
    st.integers(0, 0xFFFF).map(lambda c: f"\\u{c:04x}"),
    st.sampled_from(["\\n", '\\"', "\\\\", "\\/", "\\t", "\\b", "\\f", "\\r"]),
)
_PLAIN = st.characters(exclude_characters='"\\', exclude_categories=("Cc", "Cs"))
_RAW_SURROGATE = st.characters(categories=("Cs",))
# A string, number or literal in JSON text: what a mutation replaces.
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null')


def _quoted(parts: list[str]) -> str:
    return '"' + "".join(parts) + '"'


@dataclass(frozen=True)
class Spellings:
    """Strategies of JSON text: odd strings and numbers, and values and keys built from them."""

    strings: st.SearchStrategy[str]
    scalars: st.SearchStrategy[str]
    values: st.SearchStrategy[str]
    keys: st.SearchStrategy[str]


def spellings(words: list[str]) -> Spellings:
    # Mostly strings with something in them that a layer may choke on, among ordinary characters.
    risky = st.tuples(
        st.lists(st.one_of(_PLAIN, _ESCAPES), max_size=4),
        _ESCAPES | _RAW_SURROGATE,
        st.lists(st.one_of(_PLAIN, _ESCAPES), max_size=4),
    ).map(lambda t: _quoted([*t[0], t[1], *t[2]]))
    strings = st.one_of(
        risky, risky, st.sampled_from(words).map(lambda w: _quoted([w])), st.lists(_PLAIN, max_size=10).map(_quoted)
    )
    numbers = st.one_of(
        st.sampled_from(
            [
                "NaN",
                "Infinity",
                "-Infinity",
                "1e999",
                "-1e400",
                "1E309",
                "4.9e-325",
                "-0",
                "0e0",
                "1.7976931348623157e308",
                "-9223372036854775809",
                "18446744073709551616",
            ]
        ),
        st.integers(300, 5000).map(lambda n: "9" * n),  # past 4300 digits Python refuses the int
        st.integers(1, 400).map(lambda n: f"1{'0' * n}.5e-3"),
        st.integers(-(10**6), 10**6).map(str),
        st.floats(allow_nan=False, allow_infinity=False).map(repr),
    )
    scalars = st.one_of(strings, numbers, st.sampled_from(["true", "false", "null"]))
    keys = st.one_of(st.sampled_from(words).map(lambda w: _quoted([w])), strings)
    values = st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4).map(lambda items: "[" + ", ".join(items) + "]"),
            st.lists(st.tuples(keys, inner), max_size=4).map(
                lambda pairs: "{" + ", ".join(f"{k}: {v}" for k, v in pairs) + "}"
            ),
        ),
        max_leaves=12,
    )
    return Spellings(strings=strings, scalars=scalars, values=values, keys=keys)


def _mutate(draw: st.DrawFn, text: str, spelled: Spellings) -> str:
    """Spell one to three of the strings, numbers or literals of `text` oddly (a key only as a string)."""
    tokens = list(_TOKEN.finditer(text))
    if not tokens:
        return text
    for index in sorted(draw(st.sets(st.integers(0, len(tokens) - 1), min_size=1, max_size=3)), reverse=True):
        token = tokens[index]
        is_key = text[token.end() :].lstrip().startswith(":")
        choice = draw(st.integers(0, 9))
        spelling = spelled.strings if is_key else (spelled.values if choice == 0 else spelled.scalars)
        text = text[: token.start()] + draw(spelling) + text[token.end() :]
    return text


@st.composite
def _bodies(draw: st.DrawFn, skeletons: st.SearchStrategy[Any], fields: list[str], spelled: Spellings) -> bytes:
    roll = draw(st.integers(0, 99))
    if roll < 10:  # as the schema would have it: some get through, so the handlers behind run
        text = json.dumps(draw(skeletons))
    elif roll < 65:  # as the schema would have it, with odd spellings in it
        text = _mutate(draw, json.dumps(draw(skeletons)), spelled)
    elif roll < 80:  # the route's field names (repeated, maybe) with any values
        pairs = draw(
            st.lists(
                st.tuples(st.sampled_from(fields).map(lambda f: f'"{f}"') | spelled.keys, spelled.values),
                min_size=1,
                max_size=len(fields) + 1,
            )
        )
        text = "{" + ", ".join(f"{k}: {v}" for k, v in pairs) + "}"
    elif roll < 90:
        depth, inner = draw(st.integers(30, 3000)), draw(spelled.values)
        text = ("[" * depth + inner + "]" * depth) if draw(st.booleans()) else ('{"a": ' * depth + inner + "}" * depth)
    elif roll < 95:
        text = draw(spelled.values)
    else:  # cut short
        text = _mutate(draw, json.dumps(draw(skeletons)), spelled)
        text = text[: draw(st.integers(0, len(text)))]
    return text.encode("utf-8", "surrogatepass")


def bodies(
    spec: dict[str, Any], operation: Operation, words: list[str], spelled: Spellings
) -> st.SearchStrategy[bytes]:
    fields = list(_resolve(spec, operation.schema).get("properties", ())) or words
    return _bodies(plausible(spec, operation.schema, words), fields, spelled)


CONTENT_TYPES = ("application/json",) * 8 + (
    "application/json; charset=utf-8",
    "application/merge-patch+json",
    "text/plain",
)


def fuzz(base_url: str, key: str, known: dict[str, str], *, examples_per_operation: int, tally: Tally) -> None:
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=15) as client:
        spec = client.get("/openapi.json").json()
        operations, schema_words = body_operations(spec)
        assert len(operations) >= 10, [op.label for op in operations]
        words = sorted(schema_words | set(known.values()) | {"v2", "x", "hello world"})
        spelled = spellings(words)
        for operation in operations:
            _fuzz_operation(
                client, operation, bodies(spec, operation, words, spelled), known, examples_per_operation, tally
            )


def _fuzz_operation(
    client: httpx.Client,
    operation: Operation,
    body_texts: st.SearchStrategy[bytes],
    known: dict[str, str],
    examples: int,
    tally: Tally,
) -> None:
    # Mostly things that exist, so the handlers behind the 404s run too.
    params = st.fixed_dictionaries(
        {name: st.sampled_from([value, value, value, "nope"]) for name, value in known.items()}
    )

    @given(body=body_texts, path=params, content_type=st.sampled_from(CONTENT_TYPES))
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def run(body: bytes, path: dict[str, str], content_type: str) -> None:
        outcome: httpx.Response | Exception
        try:
            outcome = client.request(
                operation.method, operation.path.format(**path), content=body, headers={"Content-Type": content_type}
            )
        except httpx.TransportError as exc:
            outcome = exc
        tally.record(operation, body, outcome)

    run()


def fuzz_and_judge(
    base_url: str,
    key: str,
    known: dict[str, str],
    *,
    examples_per_operation: int,
    figure: Callable[[str, object], None],
) -> None:
    tally = Tally()
    started = time.monotonic()
    fuzz(base_url, key, known, examples_per_operation=examples_per_operation, tally=tally)
    figure("cases", tally.cases)
    figure("server_errors", tally.server_errors)
    figure("no_servable_version_503", tally.unroutable)
    figure("connection_resets", tally.resets)
    figure("statuses", dict(sorted(tally.statuses.items())))
    figure("seconds", round(time.monotonic() - started, 1))
    assert tally.cases >= 10 * examples_per_operation, tally.cases
    assert not tally.failures, f"{len(tally.failures)} failures in {tally.cases} cases:\n" + "\n".join(
        tally.failures[:20]
    )
    assert tally.server_errors == 0 and tally.resets == 0
    # The check itself ran: many bodies were refused as JSON, and some got past it and past the
    # schema to a handler: accepted, or a 404 for a path naming nothing (a tenant's fuzzed bodies
    # are accepted about 3 times in 3,750, too rarely to count on).
    assert tally.statuses.get(422, 0) > tally.cases // 4, tally.statuses
    assert sum(n for status, n in tally.statuses.items() if status < 300 or status == 404) > 0, tally.statuses


def test_raw_json_on_every_body_route_as_a_tenant_gets_no_5xx_and_keeps_the_connection(
    api: ApiServer,
    demo: httpx.Client,
    register_synthetic: Callable[..., str],
    figure: Callable[[str, object], None],
) -> None:
    model = register_synthetic("jfuzz")  # no worker: whatever the fuzzer queues stays queued
    known = {"model": model, "version": "v1", "tenant": "demo"}
    fuzz_and_judge(
        api.url, demo.headers["Authorization"].removeprefix("Bearer "), known, examples_per_operation=250, figure=figure
    )


def test_raw_json_on_every_body_route_as_an_admin_gets_no_5xx_and_keeps_the_connection(
    scratch_database: str,
    private_redis: RedisServer,
    tmp_path: Path,
    start_api: Callable[[Settings], ApiServer],
    figure: Callable[[str, object], None],
) -> None:
    registry = Registry(url=scratch_database, pool_size=1)
    try:
        seeded = seed(
            registry, home=tmp_path, versions=(), bootstrap_admin_key=f"sk_admin_jfuzz_{secrets.token_urlsafe(16)}"
        )
    finally:
        registry.dispose()
    api = start_api(make_settings(redis_url=private_redis.url, database_url=scratch_database, home=tmp_path))
    with http_client(api.url, seeded.admin_key) as admin:
        model = register_synthetic_model(admin, "jf", cost="fixed_s=0.001")
    known = {"model": model, "version": "v1", "tenant": "demo"}
    fuzz_and_judge(api.url, seeded.admin_key, known, examples_per_operation=400, figure=figure)
