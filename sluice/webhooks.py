"""Webhook rules with no I/O of their own: the signatures (Sluice's and Standard Webhooks'), a tenant's
active secrets, the callback URL policy, the retry schedule.

The URL policy runs twice. The API checks a callback URL when a job is submitted (its scheme, and
its address when the host is one), and the delivery task checks every address the name resolves
to just before it sends, then connects to exactly the address it checked: a name that pointed
somewhere public at submit time can point at 127.0.0.1 by then (DNS rebinding).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import random
import socket
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from functools import lru_cache
from urllib.parse import urlsplit

from sluice.errors import InvalidInput, SluiceError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

DELIVERY_HEADER = "Sluice-Delivery"
SIGNATURE_HEADER = "Sluice-Signature"
# The Standard Webhooks headers (www.standardwebhooks.com); the id is the delivery id, the same on
# every attempt, so a receiver deduplicates on it.
STANDARD_ID_HEADER = "webhook-id"
STANDARD_TIMESTAMP_HEADER = "webhook-timestamp"
STANDARD_SIGNATURE_HEADER = "webhook-signature"
SECRET_PREFIX = "whsec_"
MAX_SECRET_CHARS = 128  # the registry's column
# How long a rotated-out secret keeps signing by default (a receiver's day to switch), and at most.
DEFAULT_SECRET_OVERLAP_S = 86_400
MAX_SECRET_OVERLAP_S = 30 * 86_400
SCHEMES = frozenset({"http", "https"})
# RFC 6761: these names always mean the loopback interface, whatever a resolver says.
_LOOPBACK_NAMES = (ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1"))


class CallbackRefused(SluiceError):
    """A callback URL Sluice will not call: a scheme other than http(s), or a forbidden address."""


# --- signature -------------------------------------------------------------------------------------
#
# Two headers sign every delivery with the same secret. `Sluice-Signature` keys its HMAC with the
# secret's UTF-8 bytes, whatever its form, as it always has. The Standard Webhooks headers key theirs
# with the secret's key bytes (`signing_key`): the base64-decoded part of a `whsec_<base64>` secret,
# else the UTF-8 bytes of the plain secret.


def _mac(secret: str, timestamp: int, body: bytes) -> str:
    return hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()


def _each(secrets: str | Sequence[str]) -> tuple[str, ...]:
    return (secrets,) if isinstance(secrets, str) else tuple(secrets)


def signature(secrets: str | Sequence[str], body: bytes, *, timestamp: int) -> str:
    """The `Sluice-Signature` value: `t=<unix>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>`, one
    `v1` per active secret (two during a rotation)."""
    return ",".join([f"t={timestamp}", *(f"v1={_mac(secret, timestamp, body)}" for secret in _each(secrets))])


def verify(secret: str, header: str, body: bytes, *, tolerance_s: float = 300.0, now: float | None = None) -> bool:
    """What a receiver does: the MAC matches and the timestamp is recent (so a replay goes stale)."""
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


class InvalidWebhookSecret(InvalidInput):
    """A webhook secret Sluice will not sign with (too short, too long, or a bad `whsec_` key)."""


def signing_key(secret: str) -> bytes:
    """The Standard Webhooks key of a secret: `whsec_<base64>` gives the decoded bytes (padding
    optional, as the reference libraries read it); any other secret its UTF-8 bytes."""
    if not secret.startswith(SECRET_PREFIX):
        return secret.encode()
    encoded = secret[len(SECRET_PREFIX):]
    try:
        return base64.b64decode(encoded + "=" * (-len(encoded) % 4), validate=True)
    except ValueError:  # binascii.Error, or a character outside ASCII
        raise InvalidWebhookSecret("a whsec_ webhook secret must be whsec_ followed by base64") from None


def check_secret(secret: str) -> str:
    """A secret an admin gives: 24 to 128 printable characters without spaces, and a `whsec_` one
    a key of 24 to 64 bytes (the Standard Webhooks bounds)."""
    if not 24 <= len(secret) <= MAX_SECRET_CHARS:
        raise InvalidWebhookSecret(f"a webhook secret has 24 to {MAX_SECRET_CHARS} characters")
    if not secret.isascii() or not secret.isprintable() or any(c.isspace() for c in secret):
        raise InvalidWebhookSecret("a webhook secret is printable ASCII without spaces")
    if secret.startswith(SECRET_PREFIX) and not 24 <= len(signing_key(secret)) <= 64:
        raise InvalidWebhookSecret("a whsec_ webhook secret holds a key of 24 to 64 bytes")
    return secret


def standard_signature(secrets: str | Sequence[str], msg_id: str, body: bytes, *, timestamp: int) -> str:
    """The `webhook-signature` value: `v1,<base64 HMAC-SHA256(key, "<id>.<t>.<body>")>` per active
    secret, separated by spaces."""
    signed = f"{msg_id}.{timestamp}.".encode() + body
    return " ".join(
        "v1," + base64.b64encode(hmac.new(signing_key(secret), signed, hashlib.sha256).digest()).decode()
        for secret in _each(secrets)
    )


def verify_standard(secret: str, *, msg_id: str, timestamp: str, header: str, body: bytes,
                    tolerance_s: float = 300.0, now: float | None = None) -> bool:
    """A receiver's check of the Standard Webhooks headers: one `v1` entry of `webhook-signature`
    matches and `webhook-timestamp` is within the tolerance either way."""
    try:
        signed_at = int(timestamp)
    except ValueError:
        return False
    if not msg_id or abs((time.time() if now is None else now) - signed_at) > tolerance_s:
        return False
    expected = standard_signature(secret, msg_id, body, timestamp=signed_at).encode()
    return any(hmac.compare_digest(expected, entry.encode()) for entry in header.split() if entry.startswith("v1,"))


@dataclass(frozen=True, slots=True)
class WebhookSecrets:
    """A tenant's signing secrets: the current one, and during a rotation the one it replaced,
    which signs too until `previous_until` (unix seconds)."""

    current: str
    previous: str | None = None
    previous_until: float | None = None

    def active(self, now: float) -> tuple[str, ...]:
        """The secrets a delivery made at `now` is signed with, the current one first."""
        if self.previous and self.previous_until is not None and now < self.previous_until:
            return (self.current, self.previous)
        return (self.current,)


# --- URL policy ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Target:
    scheme: str
    host: str  # lower-case, without brackets or a trailing dot
    port: int


@lru_cache(maxsize=16)
def _networks(cidrs: tuple[str, ...]) -> tuple[IPNetwork, ...]:
    return tuple(ipaddress.ip_network(cidr, strict=False) for cidr in cidrs)


def allowed_networks(cidrs: Iterable[str]) -> tuple[IPNetwork, ...]:
    """`SLUICE_WEBHOOK_ALLOWED_NETWORKS` parsed (and cached: the API asks on every submission)."""
    return _networks(tuple(cidrs))


def parse_callback(url: str) -> Target:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise CallbackRefused(f"callback_url must use http or https, not {scheme or 'no scheme'!r}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError as exc:
        raise CallbackRefused(f"callback_url is not a valid URL: {exc}") from None
    if not host:
        raise CallbackRefused("callback_url has no host")
    return Target(scheme=scheme, host=host.rstrip("."), port=port or (443 if scheme == "https" else 80))


def literal_address(host: str) -> IPAddress | None:
    """The address a host names by itself, legacy IPv4 spellings included (`2130706433`,
    `0x7f.1`): the resolver reads those as addresses too, so the policy must."""
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        pass
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        return None


def _reached(address: IPAddress) -> list[IPAddress]:
    """The addresses a connection to `address` reaches: an IPv4-mapped IPv6 address is its IPv4
    address; a 6to4 or Teredo one leads to its embedded IPv4 address through a relay."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return [address.ipv4_mapped]
        if address.sixtofour is not None:
            return [address.sixtofour, address]
        if address.teredo is not None:
            return [address.teredo[1], address]
    return [address]


def refusal(address: IPAddress, allowed: Sequence[IPNetwork]) -> str | None:
    """Why Sluice may not call this address (e.g. 'loopback'), or None when it may."""
    candidates = _reached(address)
    if any(candidate in network for candidate in candidates for network in allowed):
        return None
    for candidate in candidates:
        for attribute, what in (
            ("is_loopback", "loopback"), ("is_link_local", "link-local"), ("is_multicast", "multicast"),
            ("is_unspecified", "unspecified"), ("is_reserved", "reserved"), ("is_private", "private"),
        ):
            if getattr(candidate, attribute):
                return what
        if not candidate.is_global:
            return "non-public"
    return None


def _refuse_unless_allowed(host: str, addresses: Sequence[IPAddress], allowed: Sequence[IPNetwork]) -> None:
    for address in addresses:
        why = refusal(address, allowed)
        if why is not None:
            named = host if host == str(address) else f"{host} ({address})"
            raise CallbackRefused(
                f"callback_url host {named} is a {why} address; webhooks to private, loopback, link-local, "
                "multicast and reserved addresses are refused unless the network is listed in "
                "SLUICE_WEBHOOK_ALLOWED_NETWORKS"
            )


def check_callback_url(url: str, *, allowed: Sequence[IPNetwork]) -> Target:
    """Submit-time check: the scheme, and the address when the host is one or a loopback name.
    Other names are checked when they are resolved, at each delivery (`pin_address`)."""
    target = parse_callback(url)
    address = literal_address(target.host)
    if address is not None:
        _refuse_unless_allowed(target.host, [address], allowed)
    elif target.host == "localhost" or target.host.endswith(".localhost"):
        _refuse_unless_allowed(target.host, _LOOPBACK_NAMES, allowed)
    return target


def pin_address(target: Target, resolved: Sequence[IPAddress], allowed: Sequence[IPNetwork]) -> IPAddress:
    """Delivery-time check: every address the host resolved to must be allowed (a name that mixes
    a public and a private address is refused), and the first one is the one to connect to."""
    if not resolved:
        raise CallbackRefused(f"callback_url host {target.host} resolved to no address")
    names_loopback = target.host == "localhost" or target.host.endswith(".localhost")
    _refuse_unless_allowed(target.host, [*resolved, *(_LOOPBACK_NAMES if names_loopback else ())], allowed)
    return resolved[0]


# --- retry schedule --------------------------------------------------------------------------------


def should_retry(status: int) -> bool:
    """Server errors and 429 may pass; any other answer (2xx aside) will not change on a retry."""
    return status == 429 or 500 <= status <= 599


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


def retry_delay(attempt: int, *, base_s: float, cap_s: float, retry_after: float | None = None,
                rng: random.Random | None = None) -> float:
    """Seconds to wait after failed attempt number `attempt` (1-based).

    Exponential from `base_s`, capped at `cap_s`, with "equal jitter": half of the step is fixed,
    half random, so a receiver that failed for many deliveries at once is not hit by all of them
    again at the same instant, and no retry comes sooner than half its step. A receiver's
    `Retry-After` is honoured up to the cap.
    """
    step = min(cap_s, base_s * 2.0 ** min(attempt - 1, 62))
    delay = step / 2 + (rng or random).uniform(0, step / 2)
    if retry_after is not None:
        delay = max(delay, min(retry_after, cap_s))
    return delay
