"""The upload limit holds while the body streams: a chunked multipart upload with no
Content-Length, far larger than the limit, is answered 413 once the limit is passed, long before
the client has sent it all, and leaves nothing in the batch store.

The client is a raw socket, so the test sees exactly how much the API took before it answered;
a parser that spools the whole body first would take all of it."""

from __future__ import annotations

import resource
import select
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from launch.seed import Seeded
from sluice.settings import Settings
from tests.support import ApiServer, make_settings, serving

LIMIT = 1 << 20
TOTAL = 256 << 20
CHUNK = 64 << 10
# What may be in flight when the API answers: the limit, the socket buffers of both ends on
# loopback (a few MiB), and a chunk or two. A quarter of the body is far above all of that.
SENT_BOUND = 64 << 20
BOUNDARY = "sluice-upload-limit"


@pytest.fixture(scope="module")
def small_api(settings: Settings, seeded: Seeded,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ApiServer, Path]]:
    """An API whose upload limit is 1 MiB, and its batch store."""
    home = tmp_path_factory.mktemp("upload-limit-home")
    limited = make_settings(redis_url=settings.require_redis_url(), database_url=settings.require_database_url(),
                            home=home, max_batch_upload_bytes=LIMIT)
    with serving(limited) as server:
        yield server, limited.batch_storage


def _part(name: str, value: bytes, filename: str | None = None) -> bytes:
    disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
    return (f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n\r\n").encode() + value + b"\r\n"


def _chunked_upload(api: ApiServer, key: str, head: bytes, body: Iterator[bytes]) -> tuple[int, int, bytes]:
    """Send `head` then `body` chunked until the API answers; answer (status, bytes sent, response)."""
    url = urlsplit(api.url)
    sent = 0
    with socket.create_connection((url.hostname or "127.0.0.1", url.port or 80), timeout=60) as sock:
        sock.sendall((f"POST /v1/batches HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {key}\r\n"
                      f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n"
                      "Transfer-Encoding: chunked\r\n\r\n").encode())
        try:
            for data in (head, *body):
                sock.sendall(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                sent += len(data)
                if select.select([sock], [], [], 0)[0]:
                    break
            else:
                sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        response = b""
        deadline = time.monotonic() + 60
        while b"\r\n\r\n" not in response and time.monotonic() < deadline:
            if not (part := sock.recv(65536)):
                break
            response += part
    return int(response.split(b" ", 2)[1]), sent, response


def _stored(storage: Path) -> set[str]:
    return {p.name for p in storage.iterdir()} if storage.is_dir() else set()


def _filler() -> Iterator[bytes]:
    line = b'{"text": "' + b"x" * 100 + b'"}\n'
    chunk = line * (CHUNK // len(line))
    for _ in range(TOTAL // len(chunk)):
        yield chunk


@pytest.mark.parametrize("shape", ["file", "field"])
def test_a_chunked_upload_over_the_limit_is_refused_while_it_streams(
    small_api: tuple[ApiServer, Path], seeded: Seeded, shape: str, figure: Callable[[str, object], None]
) -> None:
    api, storage = small_api
    before = _stored(storage)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    head = _part("model", b"intent")
    if shape == "file":
        head += (f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
                 "Content-Type: application/octet-stream\r\n\r\n").encode()
    else:  # a form field with no file name, as large: held in memory by a form parser, so bounded too
        head += f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="text_field"\r\n\r\n'.encode()
    started = time.monotonic()
    status, sent, response = _chunked_upload(api, seeded.demo_key, head, _filler())
    figure("bytes_sent_before_answer", sent)
    figure("seconds_to_answer", round(time.monotonic() - started, 2))
    figure("max_rss_growth_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before)
    assert sent < SENT_BOUND, f"the API took {sent} bytes before answering; the limit is {LIMIT}"
    assert status == 413, response
    assert _stored(storage) == before


def test_an_upload_under_the_limit_still_makes_a_batch(small_api: tuple[ApiServer, Path], seeded: Seeded) -> None:
    head = (_part("model", b"intent") + _part("text_field", b"text") + _part("file", b'{"text": "hi"}\n' * 10,
                                                                             filename="rows.jsonl")
            + f"--{BOUNDARY}--\r\n".encode())
    status, _, response = _chunked_upload(small_api[0], seeded.demo_key, head, iter(()))
    assert status == 202, response
