"""Webhook rules with no I/O of their own: the signature, the callback URL policy, the retry schedule.

The URL policy runs twice. The API checks a callback URL when a job is submitted (its scheme, and
its address when the host is one), and the delivery task checks every address the name resolves
to just before it sends, then connects to exactly the address it checked: a name that pointed
somewhere public at submit time can point at 127.0.0.1 by then (DNS rebinding).
"""

from __future__ import annotations

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

from sluice.errors import SluiceError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

DELIVERY_HEADER = "Sluice-Delivery"
SIGNATURE_HEADER = "Sluice-Signature"
SCHEMES = frozenset({"http", "https"})
# RFC 6761: these names always mean the loopback interface, whatever a resolver says.
_LOOPBACK_NAMES = (ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1"))


class CallbackRefused(SluiceError):
    """A callback URL Sluice will not call: a scheme other than http(s), or a forbidden address."""


# --- signature -------------------------------------------------------------------------------------


def _mac(secret: str, timestamp: int, body: bytes) -> str:
    return hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()


def signature(secret: str, body: bytes, *, timestamp: int) -> str:
    """The `Sluice-Signature` value: `t=<unix>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>`."""
    return f"t={timestamp},v1={_mac(secret, timestamp, body)}"


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
