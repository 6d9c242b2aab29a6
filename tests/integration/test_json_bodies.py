"""Raw JSON bodies that Python's parser takes but no layer of Sluice can hold, over the real API:
422 `invalid_json` with the error envelope on every route that reads a body, nothing queued, and
the connection still usable. The bodies are bytes, as a client could send them:
`\\ud800` here is the six characters of a JSON escape, not a Python string.

Before the check, these answered 500 (a surrogate or NaN reached the response encoder), dropped
the connection (the error handler failed on the message it built from the bad key), or 503
(U+0000 reached a Postgres text column).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from api.strict_json import MAX_DEPTH

Snapshot = Callable[[str, str], Any]
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def model(register_synthetic: Callable[..., str]) -> str:
    return register_synthetic("rawjson")


@pytest.fixture
def nothing_queued(queue_state: Snapshot, model: str) -> Callable[[], Any]:
    @contextmanager
    def check() -> Iterator[None]:
        before = queue_state(model, "v1")
        yield
        assert queue_state(model, "v1") == before

    return check


def assert_invalid_json(response: httpx.Response) -> str:
    assert response.status_code == 422, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}, body
    assert body["error"]["code"] == "invalid_json", body
    message: str = body["error"]["message"]
    return message


SUBMIT_BODIES = {
    "surrogate-in-text": rb'{"input": {"text": "\ud800"}}',
    "low-surrogate-alone": rb'{"input": {"text": "a\udfffb"}}',
    "reversed-pair": rb'{"input": {"text": "\udc00\ud800"}}',
    "surrogate-in-input-key": rb'{"input": {"\ud800": "a"}}',
    "surrogate-in-metadata-value": rb'{"input": {"text": "a"}, "metadata": {"k": "\ud800"}}',
    "surrogate-in-metadata-key": rb'{"input": {"text": "a"}, "metadata": {"\ud800": 1}}',
    "surrogate-in-top-level-key": rb'{"input": {"text": "a"}, "\uDBFF": 1}',
    "surrogate-in-routing-key": rb'{"input": {"text": "a"}, "routing_key": "\udfff"}',
    "surrogate-in-callback": rb'{"input": {"text": "a"}, "callback_url": "http://x\udfff.example/"}',
    "surrogate-deep": b'{"input": ' + b'{"a": ' * 10 + rb'"\ud800"' + b"}" * 10 + b"}",
    "raw-surrogate-bytes": b'{"input": {"text": "\xed\xa0\x80"}}',
    "nul-in-text": rb'{"input": {"text": "a\u0000b"}}',
    "nan": rb'{"input": {"text": "a"}, "metadata": {"k": NaN}}',
    "infinity": rb'{"input": {"text": "a"}, "timeout_s": Infinity}',
    "minus-infinity": rb'{"input": {"tokens": -Infinity}}',
    "float-overflow": rb'{"input": {"text": "a"}, "metadata": {"k": 1e999}}',
    "float-overflow-in-input": rb'{"input": {"tokens": 1e400}}',
    "int-past-digit-limit": b'{"input": {"tokens": 1' + b"0" * 5000 + b"}}",
    "deep-nesting": b'{"input": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    "nesting-past-max-depth": b'{"input": ' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"}",
    "duplicate-key": rb'{"input": {"text": "a", "text": "b"}}',
    "not-utf8": b'{"input": {"text": "\xff"}}',
    "truncated": b'{"input": {"text": ',
}


@pytest.mark.parametrize("body", SUBMIT_BODIES.values(), ids=SUBMIT_BODIES.keys())
def test_a_submission_with_json_no_layer_can_hold_is_refused(
    demo: httpx.Client, model: str, nothing_queued: Callable[[], Any], body: bytes
) -> None:
    with nothing_queued():
        assert_invalid_json(demo.post(f"/v1/models/{model}/jobs", content=body, headers=JSON))
        bulk = body.replace(b'{"input": ', b'{"inputs": [', 1)
        bulk = bulk[:-1] + b"]}" if bulk.endswith(b"}") else bulk
        assert_invalid_json(demo.post(f"/v1/models/{model}/jobs:bulk", content=bulk, headers=JSON))
    # The connection that carried the bad body still serves the next request.
    assert demo.get(f"/v1/models/{model}").status_code == 200


def test_the_message_names_where_and_why(demo: httpx.Client, model: str) -> None:
    message = assert_invalid_json(
        demo.post(
            f"/v1/models/{model}/jobs", content=rb'{"input": {"text": "a"}, "metadata": {"k": "x\ud800"}}', headers=JSON
        )
    )
    assert message == "body.metadata.k: the string holds a lone UTF-16 surrogate, which is not a Unicode character"
    message = assert_invalid_json(
        demo.post(
            f"/v1/models/{model}/jobs", content=rb'{"input": {"text": "a"}, "metadata": {"\ud800": 1}}', headers=JSON
        )
    )
    assert message.startswith("body.metadata: a key holds a lone UTF-16 surrogate")


def test_a_content_type_with_parameters_or_a_json_suffix_is_checked_too(demo: httpx.Client, model: str) -> None:
    body = rb'{"input": {"text": "\ud800"}}'
    for content_type in ("application/json; charset=utf-8", "application/vnd.sluice+json", "Application/JSON"):
        assert_invalid_json(demo.post(f"/v1/models/{model}/jobs", content=body, headers={"Content-Type": content_type}))


def test_valid_unicode_is_still_accepted(demo: httpx.Client, model: str) -> None:
    """A surrogate *pair* is one character (here U+1F600); non-ASCII keys and values are fine."""
    body = rb'{"input": {"text": "caf\u00e9 \ud83d\ude00 \u65e5\u672c"}, "metadata": {"\u00fc": "\ud83d\ude00"}}'
    response = demo.post(f"/v1/models/{model}/jobs", content=body, headers=JSON)
    assert response.status_code == 202, response.text
    assert response.json()["metadata"] == {"\u00fc": "\U0001f600"}
    demo.delete(f"/v1/jobs/{response.json()['id']}")


def test_an_integer_past_64_bits_comes_back_exactly(demo: httpx.Client, model: str) -> None:
    """The rules allow integers of up to 4300 digits; the answers' encoder (orjson) writes none past
    64 bits on its own, and the job must read back as it was submitted."""
    body = b'{"input": {"text": "a"}, "metadata": {"n": 1' + b"0" * 40 + b"}}"
    response = demo.post(f"/v1/models/{model}/jobs", content=body, headers=JSON)
    assert response.status_code == 202, response.text
    assert response.json()["metadata"] == {"n": 10**40}
    read = demo.get(f"/v1/jobs/{response.json()['id']}")
    assert read.status_code == 200 and read.json()["metadata"] == {"n": 10**40}, read.text
    demo.delete(f"/v1/jobs/{response.json()['id']}")


ADMIN_BODIES = {
    "create-model": ("POST", "/v1/models", rb'{"name": "x", "kind": "synthetic", "\ud800": 1}'),
    "register-version": (
        "POST",
        "/v1/models/{model}/versions",
        b'{"version": "v9", "artifact": "synthetic:?\\ud800", "sha256": "' + b"0" * 64 + b'"}',
    ),
    "routing-key": ("PUT", "/v1/models/{model}/routing", rb'{"weights": {"\ud800": 1}}'),
    "routing-reason": ("PUT", "/v1/models/{model}/routing", rb'{"weights": {"v1": 100}, "reason": "\ud800"}'),
    "routing-nul": ("PUT", "/v1/models/{model}/routing", rb'{"weights": {"v1": 100}, "reason": "a\u0000"}'),
    "routing-nan": ("PUT", "/v1/models/{model}/routing", rb'{"weights": {"v1": NaN}}'),
    "patch-version": ("PATCH", "/v1/models/{model}/versions/v1", rb'{"reason": "\udfff"}'),
    "rollback": ("POST", "/v1/models/{model}/rollback", rb'{"reason": "\ud800"}'),
    "tenant": ("POST", "/v1/tenants", rb'{"id": "t", "rate_limit_per_s": Infinity}'),
    "key": ("POST", "/v1/tenants/demo/keys", rb'{"\ud800": true}'),
    "pin": ("PUT", "/v1/tenants/demo/pins/{model}", rb'{"version": "v1", "version": "\ud800"}'),
}


@pytest.mark.parametrize("case", ADMIN_BODIES.values(), ids=ADMIN_BODIES.keys())
def test_an_admin_write_with_json_no_layer_can_hold_is_refused(
    admin: httpx.Client, model: str, case: tuple[str, str, bytes]
) -> None:
    method, path, body = case
    before = admin.get(f"/v1/models/{model}").json()
    assert_invalid_json(admin.request(method, path.format(model=model), content=body, headers=JSON))
    assert admin.get(f"/v1/models/{model}").json() == before
