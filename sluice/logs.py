"""How every Sluice process logs: one JSON object per line, redacted, with the request id.

The API takes a request id from `X-Request-Id` (or makes one), binds it for the request with
`bound_request_id`, and stores it in the job record and its stream entry, so a worker's lines
about the job carry the same id. `python-json-logger` writes the lines; the `RedactingFilter`
(sluice.redact) sits in front of every handler, so no message reaches one unscrubbed. Fields
passed with `extra=` are ids and numbers only, never inputs or outputs.
"""

from __future__ import annotations

import contextlib
import logging
import re
import secrets
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Literal

from pythonjsonlogger.json import JsonFormatter

from sluice.redact import RedactingFilter

LogFormat = Literal["json", "text"]

REQUEST_ID_HEADER = "X-Request-Id"
# A caller's id is echoed into logs and job records: only a plain token, so no free text (and no
# user data) comes in with it. Anything else is replaced by one of ours.
_REQUEST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/+=-]{0,127}")

_request_id: ContextVar[str | None] = ContextVar("sluice_request_id", default=None)

_JSON_FIELDS = ("levelname", "name", "message")


_GENERATED_PREFIX = "req_"


def new_request_id() -> str:
    return f"{_GENERATED_PREFIX}{secrets.token_hex(12)}"


def is_generated_request_id(value: str) -> bool:
    """Whether the API made this id because the caller sent none (nobody follows it by name)."""
    return value.startswith(_GENERATED_PREFIX) and len(value) == len(_GENERATED_PREFIX) + 24


def accepted_request_id(value: str | None) -> str:
    """The caller's id when it is a plain token, else a new one."""
    if value and _REQUEST_ID.fullmatch(value):
        return value
    return new_request_id()


def current_request_id() -> str | None:
    return _request_id.get()


@contextlib.contextmanager
def bound_request_id(request_id: str | None) -> Iterator[None]:
    token = _request_id.set(request_id)
    try:
        yield
    finally:
        _request_id.reset(token)


class RequestIdFilter(logging.Filter):
    """Adds the bound request id to a record that does not name one itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            request_id = _request_id.get()
            if request_id is not None:
                record.request_id = request_id
        return True


def formatter(fmt: LogFormat, *, process: str) -> logging.Formatter:
    if fmt == "text":
        return logging.Formatter(f"%(asctime)s %(levelname)s {process} %(name)s: %(message)s")
    # `timestamp`: the record's time in ISO 8601, UTC, under "time".
    return JsonFormatter(list(_JSON_FIELDS), rename_fields={"levelname": "level", "name": "logger"},
                         static_fields={"process": process}, timestamp="time", json_ensure_ascii=False)


def prepare_handler(handler: logging.Handler, *, fmt: LogFormat, process: str) -> None:
    """Give a handler (ours, or one a library installed) Sluice's format and filters."""
    handler.setFormatter(formatter(fmt, process=process))
    for wanted in (RedactingFilter, RequestIdFilter):
        if not any(isinstance(f, wanted) for f in handler.filters):
            handler.addFilter(wanted())


def configure_logging(level: str = "INFO", *, name: str = "sluice", fmt: LogFormat = "json") -> None:
    handler = logging.StreamHandler()
    prepare_handler(handler, fmt=fmt, process=name)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
