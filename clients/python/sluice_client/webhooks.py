"""A webhook receiver's side of the signature, and the `Retry-After` header the client honours.

The server signs in `sluice.webhooks`; the same HMAC is written here again so that a receiver
needs only this package. tests/unit/test_client_contract.py signs with the server's code and
verifies with this one, so the two cannot drift.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from email.utils import parsedate_to_datetime


def _mac(secret: str, timestamp: int, body: bytes) -> str:
    return hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()


def verify(secret: str, header: str, body: bytes, *, tolerance_s: float = 300.0, now: float | None = None) -> bool:
    """Whether a `Sluice-Signature` header (`t=<unix>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>`)
    signs `body`: the MAC matches and the timestamp is recent (so a replay goes stale)."""
    fields: dict[str, list[str]] = {}
    for part in header.split(","):
        name, sep, value = part.strip().partition("=")
        if sep:
            fields.setdefault(name, []).append(value)
    try:
        timestamp = int(fields["t"][0])
    except (KeyError, ValueError):
        return False
    if abs((time.time() if now is None else now) - timestamp) > tolerance_s:
        return False
    expected = _mac(secret, timestamp, body)
    return any(hmac.compare_digest(expected, candidate) for candidate in fields.get("v1", []))


def retry_after_s(value: str | None, *, now: float | None = None) -> float | None:
    """A `Retry-After` header in seconds (delta-seconds or an HTTP date), None when absent or bad."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))
