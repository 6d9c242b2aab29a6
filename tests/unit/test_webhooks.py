"""The pure webhook rules (sluice/webhooks.py): signatures, secrets, callback URL policy, retry
schedule."""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import random

import pytest

from sluice.webhooks import (
    CallbackRefused,
    InvalidWebhookSecret,
    WebhookSecrets,
    allowed_networks,
    check_callback_url,
    check_secret,
    parse_callback,
    pin_address,
    refusal,
    retry_after_s,
    retry_delay,
    should_retry,
    signature,
    signing_key,
    standard_signature,
    verify,
    verify_standard,
)
from tests.unit import standard_webhooks_vectors as vector

SECRET = "whsec-test-0123456789"
BODY = b'{"id":"job_x","status":"succeeded"}'
NONE = allowed_networks([])

# --- signature ---------------------------------------------------------------------------------------


def test_signature_is_hmac_sha256_of_timestamp_dot_body() -> None:
    expected = hmac.new(SECRET.encode(), b"1700000000." + BODY, hashlib.sha256).hexdigest()
    assert signature(SECRET, BODY, timestamp=1700000000) == f"t=1700000000,v1={expected}"


def test_a_fresh_signature_verifies() -> None:
    header = signature(SECRET, BODY, timestamp=1700000000)
    assert verify(SECRET, header, BODY, now=1700000010)


@pytest.mark.parametrize("case", ["other-secret", "other-body", "stale", "future", "garbled", "no-v1", "no-t"])
def test_a_wrong_or_stale_signature_does_not_verify(case: str) -> None:
    header = signature(SECRET, BODY, timestamp=1700000000)
    secret, body, now = SECRET, BODY, 1700000000.0
    if case == "other-secret":
        secret = "another-secret-value"
    elif case == "other-body":
        body = BODY.replace(b"succeeded", b"failed")
    elif case == "stale":
        now += 301
    elif case == "future":
        now -= 301
    elif case == "garbled":
        header = "t=abc,v1=00"
    elif case == "no-v1":
        header = "t=1700000000"
    elif case == "no-t":
        header = header.split(",", 1)[1]
    assert not verify(secret, header, body, now=now)


def test_any_of_several_v1_values_may_match() -> None:
    """Room for a secret rotation: a receiver accepts the header if one v1 matches."""
    good = signature(SECRET, BODY, timestamp=1700000000)
    header = good.replace("v1=", "v1=" + "0" * 64 + ",v1=")
    assert verify(SECRET, header, BODY, now=1700000000)


def test_each_active_secret_adds_a_v1_that_verifies_alone() -> None:
    header = signature([SECRET, "the-previous-secret-value"], BODY, timestamp=1700000000)
    assert header.count("v1=") == 2 and header.startswith("t=1700000000,")
    assert verify(SECRET, header, BODY, now=1700000000)
    assert verify("the-previous-secret-value", header, BODY, now=1700000000)
    assert not verify("a-third-secret-value", header, BODY, now=1700000000)


# --- Standard Webhooks ---------------------------------------------------------------------------------


def _verify_vector(header: str, *, secret: str = vector.SECRET, now: float = vector.TIMESTAMP,
                   msg_id: str = vector.MSG_ID, timestamp: str = str(vector.TIMESTAMP),
                   body: bytes = vector.PAYLOAD) -> bool:
    return verify_standard(secret, msg_id=msg_id, timestamp=timestamp, header=header, body=body,
                           tolerance_s=vector.TOLERANCE_S, now=now)


def test_the_published_vector_is_signed_as_published() -> None:
    assert standard_signature(vector.SECRET, vector.MSG_ID, vector.PAYLOAD,
                              timestamp=vector.TIMESTAMP) == vector.SIGNATURE


@pytest.mark.parametrize(("case", "header", "changes", "verifies"), [
    ("valid", vector.SIGNATURE, {}, True),
    ("one character off", vector.BAD_SIGNATURE, {}, False),
    ("valid among strangers and a v2", vector.MULTI_SIGNATURE, {}, True),
    ("only strangers", vector.MULTI_SIGNATURE.replace(vector.SIGNATURE, ""), {}, False),
    ("too old", vector.SIGNATURE, {"now": vector.TIMESTAMP + vector.TOLERANCE_S + 1}, False),
    ("too new", vector.SIGNATURE, {"now": vector.TIMESTAMP - vector.TOLERANCE_S - 1}, False),
    ("just within the tolerance", vector.SIGNATURE, {"now": vector.TIMESTAMP + vector.TOLERANCE_S}, True),
    ("timestamp not a number", vector.SIGNATURE, {"timestamp": "hello"}, False),
    ("no id", vector.SIGNATURE, {"msg_id": ""}, False),
    ("another id", vector.SIGNATURE, {"msg_id": "msg_other"}, False),
    ("another timestamp", vector.SIGNATURE, {"timestamp": str(vector.TIMESTAMP + 1)}, False),
    ("another body", vector.SIGNATURE, {"body": b'{"test": 2432232315}'}, False),
    ("no signature", "", {}, False),
])
def test_the_published_verification_cases(case: str, header: str, changes: dict[str, object], verifies: bool) -> None:
    assert _verify_vector(header, **changes) is verifies, case  # type: ignore[arg-type]


def test_a_whsec_secret_is_keyed_by_its_decoded_bytes_and_a_plain_one_by_its_utf8() -> None:
    assert signing_key(vector.SECRET) == base64.b64decode("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    assert signing_key("whsec_dGVzdA") == b"test"  # unpadded base64, as the reference libraries allow
    plain = "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"  # the same characters without the prefix: a plain secret
    assert signing_key(plain) == plain.encode()
    by_hand = hmac.new(plain.encode(), f"{vector.MSG_ID}.{vector.TIMESTAMP}.".encode() + vector.PAYLOAD,
                       hashlib.sha256).digest()
    assert standard_signature(plain, vector.MSG_ID, vector.PAYLOAD, timestamp=vector.TIMESTAMP) == \
        "v1," + base64.b64encode(by_hand).decode()
    assert not _verify_vector(vector.SIGNATURE, secret=plain)


def test_sluice_signature_keys_any_secret_by_its_utf8_as_before() -> None:
    expected = hmac.new(vector.SECRET.encode(), b"1700000000." + BODY, hashlib.sha256).hexdigest()
    assert signature(vector.SECRET, BODY, timestamp=1700000000) == f"t=1700000000,v1={expected}"


def test_two_secrets_give_two_space_separated_entries_each_verifying_alone() -> None:
    other = "whsec_" + base64.b64encode(b"k" * 32).decode()
    header = standard_signature([vector.SECRET, other], vector.MSG_ID, vector.PAYLOAD, timestamp=vector.TIMESTAMP)
    first, second = header.split(" ")
    assert first == vector.SIGNATURE
    assert second == standard_signature(other, vector.MSG_ID, vector.PAYLOAD, timestamp=vector.TIMESTAMP)
    assert _verify_vector(header) and _verify_vector(header, secret=other)
    assert not _verify_vector(header, secret="whsec_" + base64.b64encode(b"x" * 32).decode())


@pytest.mark.parametrize("secret", [
    "short",
    "x" * 129,
    "has a space in it, twenty-four+",
    "non-ascii-é-0123456789abcdef",
    "whsec_not*base64*at*all*0123456789",
    "whsec_" + base64.b64encode(b"k" * 23).decode(),
    "whsec_" + base64.b64encode(b"k" * 65).decode(),
])
def test_a_secret_outside_the_bounds_is_refused_without_repeating_it(secret: str) -> None:
    with pytest.raises(InvalidWebhookSecret) as refused:
        check_secret(secret)
    assert refused.value.status == 422 and secret not in str(refused.value)


@pytest.mark.parametrize("secret", [
    vector.SECRET, "whsec_" + base64.b64encode(b"k" * 64).decode(), "a-plain-secret-of-24-chars", "p" * 128,
])
def test_a_secret_within_the_bounds_is_taken_as_given(secret: str) -> None:
    assert check_secret(secret) == secret


def test_the_replaced_secret_signs_until_its_end_and_not_after() -> None:
    rotating = WebhookSecrets(current="new", previous="old", previous_until=1_000.0)
    assert rotating.active(999.9) == ("new", "old")
    assert rotating.active(1_000.0) == ("new",)
    assert WebhookSecrets(current="only").active(0.0) == ("only",)
    assert WebhookSecrets(current="new", previous=None, previous_until=1_000.0).active(0.0) == ("new",)


# --- URL policy ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("url", "why"), [
    ("http://127.0.0.1/hook", "loopback"),
    ("http://127.8.9.10:8080/hook", "loopback"),
    ("http://[::1]/hook", "loopback"),
    ("http://localhost:9000/hook", "loopback"),
    ("http://api.localhost/hook", "loopback"),
    ("http://LOCALHOST./hook", "loopback"),
    ("http://10.1.2.3/hook", "private"),
    ("http://172.16.0.1/hook", "private"),
    ("http://192.168.1.1/hook", "private"),
    ("http://[fc00::1]/hook", "private"),
    ("http://169.254.169.254/latest/meta-data", "link-local"),
    ("http://[fe80::1]/hook", "link-local"),
    ("http://224.0.0.1/hook", "multicast"),
    ("http://[ff02::1]/hook", "multicast"),
    ("http://0.0.0.0/hook", "unspecified"),
    ("http://240.0.0.1/hook", "reserved"),
    ("http://100.64.0.1/hook", "non-public"),
    # The same loopback address in spellings a resolver accepts too.
    ("http://2130706433/hook", "loopback"),
    ("http://0x7f.1/hook", "loopback"),
    ("http://127.1/hook", "loopback"),
    ("http://[::ffff:127.0.0.1]/hook", "loopback"),
    ("http://[::ffff:10.0.0.1]/hook", "private"),
    ("http://[2002:7f00:1::]/hook", "loopback"),  # 6to4 around 127.0.0.1
])
def test_forbidden_addresses_are_refused_at_submit(url: str, why: str) -> None:
    with pytest.raises(CallbackRefused, match=f"is a {why} address.*SLUICE_WEBHOOK_ALLOWED_NETWORKS"):
        check_callback_url(url, allowed=NONE)


@pytest.mark.parametrize("url", [
    "https://hooks.example.com/sluice?token=abc",
    "http://93.184.216.34:8080/hook",
    "https://[2606:4700:4700::1111]/hook",
    "https://user:pass@receiver.example.org/hook",
])
def test_public_addresses_and_names_pass_at_submit(url: str) -> None:
    target = check_callback_url(url, allowed=NONE)
    assert target.scheme in {"http", "https"}


@pytest.mark.parametrize("url", ["ftp://example.com/x", "file:///etc/passwd", "gopher://example.com/",
                                 "javascript:alert(1)", "//example.com/hook", "http:///nohost"])
def test_only_http_and_https_urls_with_a_host(url: str) -> None:
    with pytest.raises(CallbackRefused, match="http or https|no host"):
        check_callback_url(url, allowed=NONE)


def test_allowed_networks_let_exactly_their_addresses_through() -> None:
    allowed = allowed_networks(["127.0.0.0/8", "fd00::/8"])
    assert check_callback_url("http://127.0.0.1:8080/hook", allowed=allowed).port == 8080
    assert check_callback_url("http://[fd12::5]/hook", allowed=allowed).host == "fd12::5"
    with pytest.raises(CallbackRefused, match="private"):
        check_callback_url("http://10.0.0.1/hook", allowed=allowed)
    # localhost names both loopback addresses, and ::1 is not in the allowed networks.
    with pytest.raises(CallbackRefused, match=r"localhost \(::1\)"):
        check_callback_url("http://localhost/hook", allowed=allowed)
    assert check_callback_url("http://localhost/", allowed=allowed_networks(["127.0.0.0/8", "::1/128"]))
    # An allowed IPv4 network covers the same address written as IPv4-mapped IPv6.
    assert refusal(ipaddress.ip_address("::ffff:127.0.0.1"), allowed) is None


def test_default_ports_follow_the_scheme() -> None:
    assert parse_callback("https://example.com/x").port == 443
    assert parse_callback("http://example.com/x").port == 80
    with pytest.raises(CallbackRefused, match="not a valid URL"):
        parse_callback("http://example.com:99999/x")


def test_delivery_refuses_a_name_that_now_resolves_to_a_private_address() -> None:
    """DNS rebinding: the name passed at submit time; at delivery it resolves to 10.0.0.7."""
    target = check_callback_url("https://rebind.example.net/hook", allowed=NONE)
    with pytest.raises(CallbackRefused, match=r"rebind.example.net \(10.0.0.7\) is a private"):
        pin_address(target, [ipaddress.ip_address("10.0.0.7")], NONE)


def test_delivery_refuses_a_name_that_mixes_public_and_private_addresses() -> None:
    target = parse_callback("https://mixed.example.net/hook")
    resolved = [ipaddress.ip_address("93.184.216.34"), ipaddress.ip_address("127.0.0.1")]
    with pytest.raises(CallbackRefused, match="loopback"):
        pin_address(target, resolved, NONE)
    with pytest.raises(CallbackRefused, match="resolved to no address"):
        pin_address(target, [], NONE)


def test_delivery_pins_the_first_checked_address() -> None:
    target = parse_callback("https://ok.example.net/hook")
    resolved = [ipaddress.ip_address("93.184.216.34"), ipaddress.ip_address("2606:4700:4700::1111")]
    assert pin_address(target, resolved, NONE) == resolved[0]
    allowed = allowed_networks(["127.0.0.0/8"])
    assert str(pin_address(parse_callback("http://127.0.0.1:9/"), [ipaddress.ip_address("127.0.0.1")],
                           allowed)) == "127.0.0.1"


# --- retry schedule -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("status", "retry"), [
    (500, True), (502, True), (503, True), (599, True), (429, True),
    (400, False), (401, False), (404, False), (410, False), (422, False), (301, False), (302, False),
])
def test_only_server_errors_and_429_are_retried(status: int, retry: bool) -> None:
    assert should_retry(status) is retry


def test_backoff_doubles_within_its_jitter_band_and_stops_at_the_cap() -> None:
    rng = random.Random(7)
    for attempt in range(1, 40):
        step = min(60.0, 1.0 * 2 ** (attempt - 1))
        delays = [retry_delay(attempt, base_s=1.0, cap_s=60.0, rng=rng) for _ in range(200)]
        assert all(step / 2 <= d <= step for d in delays), (attempt, min(delays), max(delays))
        # Jittered: the delays of one attempt spread over its band.
        assert max(delays) - min(delays) > step / 4
    assert retry_delay(10_000, base_s=1.0, cap_s=60.0, rng=rng) <= 60.0


def test_backoff_is_reproducible_with_a_seeded_rng() -> None:
    first = [retry_delay(n, base_s=0.5, cap_s=30.0, rng=random.Random(3)) for n in range(1, 10)]
    again = [retry_delay(n, base_s=0.5, cap_s=30.0, rng=random.Random(3)) for n in range(1, 10)]
    assert first == again


def test_retry_after_is_honoured_up_to_the_cap() -> None:
    rng = random.Random(1)
    assert retry_delay(1, base_s=1.0, cap_s=60.0, retry_after=30.0, rng=rng) == 30.0
    assert retry_delay(1, base_s=1.0, cap_s=60.0, retry_after=3600.0, rng=rng) == 60.0
    # A Retry-After shorter than the backoff does not shorten it.
    assert retry_delay(6, base_s=1.0, cap_s=60.0, retry_after=1.0, rng=rng) >= 16.0


def test_retry_after_header_forms() -> None:
    assert retry_after_s("120") == 120.0
    assert retry_after_s(None) is None
    assert retry_after_s("soon") is None
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0) == pytest.approx(10.0)
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412490.0) == 0.0
