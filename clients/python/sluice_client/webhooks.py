"""A webhook receiver's side of the signatures, and the `Retry-After` header the client honours.

The server signs in `sluice.webhooks`; the same HMACs are written here again so that a receiver
needs only this package. tests/unit/test_client_contract.py signs with the server's code and
verifies with this one, so the two cannot drift.

Every delivery carries two signatures with the same secret: `Sluice-Signature` (HMAC keyed with
the secret's UTF-8 bytes) and the Standard Webhooks headers `webhook-id`, `webhook-timestamp`,
`webhook-signature` (keyed with the base64-decoded part of a `whsec_` secret, else with its UTF-8
bytes). During a rotation each carries one signature per active secret.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from collections.abc import Iterable, Mapping
from email.utils import parsedate_to_datetime

SIGNATURE_HEADER = "sluice-signature"
STANDARD_HEADERS = ("webhook-id", "webhook-timestamp", "webhook-signature")
SECRET_PREFIX = "whsec_"


def _mac(secret: str, timestamp: int, body: bytes) -> str:
    return hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()


def _fresh(timestamp: int, tolerance_s: float, now: float | None) -> bool:
    return abs((time.time() if now is None else now) - timestamp) <= tolerance_s


def _verify_sluice(secrets: tuple[str, ...], header: str, body: bytes, tolerance_s: float, now: float | None) -> bool:
    fields: dict[str, list[str]] = {}
    for part in header.split(","):
        name, sep, value = part.strip().partition("=")
        if sep:
            fields.setdefault(name, []).append(value)
    try:
        timestamp = int(fields["t"][0])
    except (KeyError, ValueError):
        return False
    if not _fresh(timestamp, tolerance_s, now):
        return False
    candidates = fields.get("v1", [])
    return any(hmac.compare_digest(_mac(secret, timestamp, body), candidate)
               for secret in secrets for candidate in candidates)


def signing_key(secret: str) -> bytes:
    """The Standard Webhooks key of a secret: the decoded part of `whsec_<base64>`, else the
    secret's UTF-8 bytes. A `whsec_` secret that is not base64 raises ValueError."""
    if not secret.startswith(SECRET_PREFIX):
        return secret.encode()
    encoded = secret[len(SECRET_PREFIX):]
    try:
        return base64.b64decode(encoded + "=" * (-len(encoded) % 4), validate=True)
    except ValueError:  # binascii.Error, or a character outside ASCII
        raise ValueError("a whsec_ webhook secret must be whsec_ followed by base64") from None


def _verify_standard(secrets: tuple[str, ...], msg_id: str, timestamp: str, header: str, body: bytes,
                     tolerance_s: float, now: float | None) -> bool:
    try:
        signed_at = int(timestamp)
    except ValueError:
        return False
    if not msg_id or not _fresh(signed_at, tolerance_s, now):
        return False
    signed = f"{msg_id}.{signed_at}.".encode() + body
    entries = [entry.encode() for entry in header.split() if entry.startswith("v1,")]
    for secret in secrets:
        expected = b"v1," + base64.b64encode(hmac.new(signing_key(secret), signed, hashlib.sha256).digest())
        if any(hmac.compare_digest(expected, entry) for entry in entries):
            return True
    return False


def verify(secret: str | Iterable[str], header: str | Mapping[str, str], body: bytes, *,
           tolerance_s: float = 300.0, now: float | None = None) -> bool:
    """Whether a delivery's signature signs `body` (the raw bytes, before any JSON parsing) and is
    recent (within `tolerance_s` either way, so a replay goes stale).

    `header` is the `Sluice-Signature` value (`t=<unix>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>`),
    or the request's headers (any mapping; names in any case): then each form present, the Sluice
    header and the Standard Webhooks ones, must verify, and at least one must be there. `secret` may
    be several (a receiver part-way through a rotation): any of them may match. A `whsec_` secret
    that is not base64 raises ValueError rather than failing every delivery quietly.
    """
    secrets = (secret,) if isinstance(secret, str) else tuple(secret)
    if isinstance(header, str):
        return _verify_sluice(secrets, header, body, tolerance_s, now)
    headers = {name.lower(): value for name, value in header.items()}
    checks: list[bool] = []
    if SIGNATURE_HEADER in headers:
        checks.append(_verify_sluice(secrets, headers[SIGNATURE_HEADER], body, tolerance_s, now))
    if any(name in headers for name in STANDARD_HEADERS):
        msg_id, timestamp, signature = (headers.get(name, "") for name in STANDARD_HEADERS)
        checks.append(_verify_standard(secrets, msg_id, timestamp, signature, body, tolerance_s, now))
    return bool(checks) and all(checks)


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
