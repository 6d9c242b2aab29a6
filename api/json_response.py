"""JSON answers of the hot routes, written by orjson and sent as they are.

A route that declares a `response_model` and returns a dict has FastAPI validate the dict
through the model and dump it again; for a job read that was most of the cost of the answer. The
kernel's bodies already are what the models promise (tests/unit/test_response_models.py holds them
equal), so the hot routes keep the model for `/openapi.json` and answer a `JsonResponse`, which
FastAPI sends untouched.
"""

from __future__ import annotations

import json
from typing import Any

import orjson
from starlette.responses import Response


def render(content: Any) -> bytes:
    """`content` as compact UTF-8 JSON; bytes are taken as JSON already."""
    if isinstance(content, bytes):
        return content
    try:
        return orjson.dumps(content)
    except orjson.JSONEncodeError:
        # orjson refuses integers past 64 bits, which a job's metadata may hold (request bodies may
        # carry integers of up to 4300 digits): the standard encoder writes them.
        return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


class JsonResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return render(content)
