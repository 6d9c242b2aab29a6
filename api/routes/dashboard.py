"""`/dashboard`, the operator's page: a static shell and its script and style, no build step.

The shell holds no data and is served without a key. The script asks for an admin key, keeps it
in the tab's sessionStorage and calls the admin API with it (the models, each version's stats and
series, the queue, the audit log, the current rollout), so every figure is behind the same checks
as a curl. The Content-Security-Policy lets the page run only its own script and talk only to its
own origin: a string from the registry (a reason, a version name) can never run as code.
"""

from __future__ import annotations

import hashlib
from functools import cache
from importlib import resources

from fastapi import APIRouter, Request, Response

from sluice.errors import NotFound

router = APIRouter(include_in_schema=False)

_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

# The only files served, by name: a request can never reach another file of the package.
_TYPES = {
    "dashboard.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}


@cache
def _asset(name: str) -> tuple[bytes, str]:
    body = resources.files("api").joinpath("static", name).read_bytes()
    return body, '"' + hashlib.sha256(body).hexdigest()[:16] + '"'


def _serve(request: Request, name: str) -> Response:
    body, etag = _asset(name)
    headers = {
        "ETag": etag,
        # Revalidated on each load (a 304 when unchanged), so an upgraded API never runs an old script.
        "Cache-Control": "no-cache",
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
    }
    if name.endswith(".html"):
        headers["Content-Security-Policy"] = _CSP
        headers["X-Frame-Options"] = "DENY"
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers=headers)
    return Response(body, media_type=_TYPES[name], headers=headers)


@router.get("/dashboard")
async def dashboard(request: Request) -> Response:
    return _serve(request, "dashboard.html")


@router.get("/dashboard/static/{name}")
async def dashboard_asset(name: str, request: Request) -> Response:
    if name not in _TYPES or name.endswith(".html"):
        raise NotFound(f"no dashboard file '{name}'")
    return _serve(request, name)
