"""Pure ASGI middleware (BaseHTTPMiddleware would lose contextvars and buffer streaming bodies)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.routing import APIRoute
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.strict_json import JsonRefused, parse
from sluice.logs import REQUEST_ID_HEADER, accepted_request_id, bound_request_id
from sluice.metrics import API_LATENCY, API_REQUESTS

# Where StrictJsonMiddleware leaves the value it parsed, for StrictJsonRoute.
PARSED_BODY = "sluice.parsed_body"

# No route reads a body sent with these: neither middleware reads one (so neither holds one unbounded).
_BODILESS_METHODS = ("GET", "HEAD", "DELETE", "OPTIONS")


async def _send_error(send: Send, status: int, code: str, message: str) -> None:
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class BodyLimitMiddleware:
    """Refuse bodies over `max_bytes` with 413: by Content-Length, and for chunked bodies by
    reading them (bounded) before the app sees them. Raising from `receive` instead would be
    swallowed by FastAPI's body parser and come out as a 400."""

    def __init__(self, app: ASGIApp, *, max_bytes: int, upload_paths: frozenset[str] = frozenset(),
                 max_upload_bytes: int = 0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        # File uploads (multipart/form-data to these paths) are streamed by their route, which
        # counts them against `max_upload_bytes` as they arrive (api/uploads.py); only a declared
        # length is checked here.
        self.upload_paths = upload_paths
        self.max_upload_bytes = max_upload_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope.get("path") in self.upload_paths and _is_multipart(scope):
            await self._upload(scope, receive, send)
            return
        declared: int | None = None
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await _send_error(send, 400, "bad_request", "invalid Content-Length")
                    return
        if declared is not None:
            if declared > self.max_bytes:
                await _send_error(send, 413, "payload_too_large",
                                  f"the body is {declared} bytes; the limit is {self.max_bytes}")
                return
            await self.app(scope, receive, send)
            return
        if scope.get("method") in _BODILESS_METHODS:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await _send_error(send, 413, "payload_too_large", f"the body exceeds {self.max_bytes} bytes")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replaying(b"".join(chunks), receive), send)


    async def _upload(self, scope: Scope, receive: Receive, send: Send) -> None:
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_upload_bytes:
                await _send_error(send, 413, "payload_too_large",
                                  f"the upload is {int(value)} bytes; the limit is {self.max_upload_bytes}")
                return
        await self.app(scope, receive, send)


def _is_multipart(scope: Scope) -> bool:
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            return bytes(value).split(b";", 1)[0].strip().lower() == b"multipart/form-data"
    return False


def _replaying(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands the app a body already read, then whatever comes after it."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _is_json(scope: Scope) -> bool:
    """The content types FastAPI parses as JSON: application/json and application/*+json."""
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            main, _, sub = bytes(value).split(b";", 1)[0].strip().lower().partition(b"/")
            return main == b"application" and (sub == b"json" or sub.endswith(b"+json"))
    return False


class StrictJsonMiddleware:
    """Refuse, with 422 `invalid_json`, a JSON body that `strict_json.parse` refuses, whatever the
    route: no handler, validation message or store ever sees a lone surrogate, NaN or the like.

    Runs inside BodyLimitMiddleware, so the body it reads is already bounded. The value it parsed
    is left in the scope (`PARSED_BODY`): routes of a `StrictJsonRoute` router validate it instead
    of having FastAPI parse the body again.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in _BODILESS_METHODS or not _is_json(scope):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body: there is no one to answer
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if body:
            try:
                scope[PARSED_BODY] = parse(body)
            except JsonRefused as exc:
                await _send_error(send, 422, "invalid_json", str(exc))
                return
        await self.app(scope, _replaying(body, receive), send)


class _StrictlyParsed(Request):
    async def json(self) -> Any:
        if PARSED_BODY in self.scope:
            return self.scope[PARSED_BODY]
        return await super().json()


class StrictJsonRoute(APIRoute):
    """A route whose JSON body FastAPI takes from StrictJsonMiddleware's parse rather than parsing
    it a second time (FastAPI's documented way to customise the request: a route class)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def parsed_once(request: Request) -> Response:
            return await handler(_StrictlyParsed(request.scope, request.receive))

        return parsed_once


class MetricsMiddleware:
    """Request counts and latency by route template (never by raw path: ids would explode labels)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def tracking_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", "unmatched")
            method = scope.get("method", "GET")
            API_REQUESTS.labels(template, method, str(status)).inc()
            API_LATENCY.labels(template, method).observe(time.perf_counter() - start)


class RequestIdMiddleware:
    """Binds the request id (the caller's `X-Request-Id` when it is a plain token, else a new one)
    for the request's log lines and job records, and answers it in the same header."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = Headers(scope=scope).get(REQUEST_ID_HEADER)
        request_id = accepted_request_id(sent)
        encoded = request_id.encode("ascii")

        async def tagging_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", encoded)]
            await send(message)

        with bound_request_id(request_id):
            await self.app(scope, receive, tagging_send)
