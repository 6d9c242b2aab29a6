"""The operator commands' API client retries a 429 or 503 (which queued nothing) after its
Retry-After, at most `RETRIES` times, and hands any other error back at once."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator

import pytest

from launch.api_client import RETRIES, ApiClient, ApiError


class _Scripted(http.server.BaseHTTPRequestHandler):
    answers: list[int] = []
    seen: list[str] = []

    def do_GET(self) -> None:
        self.seen.append(self.path)
        status = self.answers.pop(0) if self.answers else 200
        body = {"models": []} if status == 200 else {"error": {"code": "busy", "message": "try later"}}
        payload = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        if status in (429, 503):
            self.send_header("Retry-After", "0")
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *_: object) -> None:
        """Quiet."""


@pytest.fixture
def server() -> Iterator[str]:
    _Scripted.answers, _Scripted.seen = [], []
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_a_429_or_503_is_sent_again_until_it_succeeds(server: str) -> None:
    _Scripted.answers = [429, 503]
    with ApiClient(base_url=server, api_key="k") as client:
        assert client.models() == []
    assert len(_Scripted.seen) == 3


def test_it_gives_up_after_its_retries_with_the_apis_error(server: str) -> None:
    _Scripted.answers = [503] * (RETRIES + 5)
    with ApiClient(base_url=server, api_key="k") as client, pytest.raises(ApiError) as raised:
        client.models()
    assert raised.value.status == 503 and raised.value.code == "busy"
    assert len(_Scripted.seen) == RETRIES + 1


def test_another_error_is_not_sent_again(server: str) -> None:
    _Scripted.answers = [404]
    with ApiClient(base_url=server, api_key="k") as client, pytest.raises(ApiError) as raised:
        client.models()
    assert raised.value.status == 404
    assert len(_Scripted.seen) == 1
