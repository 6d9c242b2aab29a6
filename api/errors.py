"""Every error leaves the API as `{"error": {"code", "message"}}` with the right status."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sluice.errors import ApiError, BrokerError, RegistryError

log = logging.getLogger(__name__)

_HTTP_CODES = {
    400: "bad_request", 401: "unauthenticated", 403: "forbidden", 404: "not_found",
    405: "method_not_allowed", 409: "conflict", 413: "payload_too_large", 415: "unsupported_media_type",
    422: "invalid_input", 429: "too_many_requests", 503: "service_unavailable",
}


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None,
                   details: dict[str, Any] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message, **(details or {})}}, status_code=status,
                        headers=headers)


def _describe_validation(exc: RequestValidationError) -> str:
    parts = []
    for error in exc.errors()[:3]:
        where = ".".join(str(p) for p in error.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {error.get('msg', 'invalid')}")
    return "; ".join(parts) or "the request is not valid"


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.code, exc.message, exc.headers, exc.details)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(422, "invalid_request", _describe_validation(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, "error")
        message = exc.detail if isinstance(exc.detail, str) else code
        return error_response(exc.status_code, code, message, dict(exc.headers or {}))

    @app.exception_handler(BrokerError)
    async def _broker(_: Request, exc: BrokerError) -> JSONResponse:
        log.warning("Redis unavailable: %s", exc)
        return error_response(503, "broker_unavailable", "the job queue is unavailable; retry shortly",
                              {"Retry-After": "1"})

    @app.exception_handler(RegistryError)
    async def _registry(_: Request, exc: RegistryError) -> JSONResponse:
        log.warning("registry unavailable: %s", exc)
        return error_response(503, "registry_unavailable", "the model registry is unavailable; retry shortly",
                              {"Retry-After": "2"})

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error: %s", type(exc).__name__, exc_info=exc)
        return error_response(500, "internal", "internal error")
