"""Redaction of user data before it reaches a log line (sluice.redact)."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest

from sluice.redact import RedactingFilter, fingerprint, scrub


@pytest.mark.parametrize("text, secret, replacement", [
    ("mail me at john.doe+tag@example.co.uk today", "john.doe+tag@example.co.uk", "[email]"),
    ("FROM: Alice.Smith@Corp.COM", "Alice.Smith@Corp.COM", "[email]"),
    ("card 4111 1111 1111 1111 expires soon", "4111 1111 1111 1111", "[card]"),
    ("card 4111-1111-1111-1111", "4111-1111-1111-1111", "[card]"),
    ("pan=4111111111111111;", "4111111111111111", "[card]"),
    ("amex 3782 822463 10005", "3782 822463 10005", "[card]"),
    ("call +1 (555) 123-4567 tonight", "555) 123-4567", "[phone]"),
    ("call 555-123-4567", "555-123-4567", "[phone]"),
    ("uk +44 20 7946 0958", "+44 20 7946 0958", "[phone]"),
    ("Authorization: Bearer abc.DEF-123_xyz~+/=", "abc.DEF-123_xyz~+/=", "Bearer [key]"),
    ("header bearer sk_demo_AbCdEfGhIjKl", "sk_demo_AbCdEfGhIjKl", "Bearer [key]"),
    ("the key sk_live_0123456789abcdef leaked", "sk_live_0123456789abcdef", "[key]"),
    ('{"api_key": "sk_demo_Zx-9_aaaaaaaa"}', "sk_demo_Zx-9_aaaaaaaa", "[key]"),
], ids=["email", "email-case", "card-spaces", "card-dashes", "card-plain", "card-amex", "phone-intl",
        "phone-us", "phone-uk", "bearer", "bearer-sk", "sk-key", "sk-in-json"])
def test_scrub_removes_the_secret(text: str, secret: str, replacement: str) -> None:
    scrubbed = scrub(text)
    assert secret not in scrubbed
    assert replacement in scrubbed


def test_scrub_leaves_no_digits_of_a_card_or_phone() -> None:
    scrubbed = scrub("pay with 5500 0000 0000 0004 or call +1 (415) 555-2671")
    assert not any(ch.isdigit() for ch in scrubbed), scrubbed


@pytest.mark.parametrize("text", [
    "worker w-1 finished a batch of 32 in 12.5 ms",
    "job job_Ab3dEf9 is queued on minilm v1",
    "order 12345 shipped",
    "sk_short is not a key",
    "",
])
def test_scrub_keeps_ordinary_text(text: str) -> None:
    assert scrub(text) == text


def test_scrub_handles_several_secrets_in_one_line() -> None:
    scrubbed = scrub("a@b.io paid 4111 1111 1111 1111 with Bearer tok123 and sk_test_abcdefgh1")
    assert scrubbed.count("[email]") == 1 and scrubbed.count("[card]") == 1
    assert scrubbed.count("[key]") == 2
    for secret in ("a@b.io", "4111", "tok123", "sk_test_abcdefgh1"):
        assert secret not in scrubbed


def test_fingerprint_is_stable_short_and_reveals_nothing() -> None:
    payload = {"text": "my email is a@b.com", "n": 1}
    first = fingerprint(payload)
    assert first == fingerprint({"n": 1, "text": "my email is a@b.com"})  # key order does not matter
    assert first != fingerprint({"text": "my email is a@b.co", "n": 1})
    assert first.startswith("sha256:") and "a@b.com" not in first
    canonical = '{"n":1,"text":"my email is a@b.com"}'
    assert first.endswith(f" len={len(canonical)}")


@pytest.fixture
def captured() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    """A logger whose only handler carries the RedactingFilter, as configure_logging sets up."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(RedactingFilter())
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger = logging.getLogger("tests.redact")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    yield logger, stream
    logger.handlers.clear()


def test_filter_scrubs_formatted_arguments(captured: tuple[logging.Logger, io.StringIO]) -> None:
    logger, stream = captured
    logger.warning("input from %s with card %s", "eve@example.org", "4111 1111 1111 1111")
    logger.info("%(who)s sent %(key)s", {"who": "bob@example.org", "key": "sk_live_abcdefgh1234"})
    out = stream.getvalue()
    assert "eve@example.org" not in out and "4111" not in out
    assert "bob@example.org" not in out and "sk_live_abcdefgh1234" not in out
    assert "WARNING input from [email] with card [card]" in out
    assert "INFO [email] sent [key]" in out


def test_filter_scrubs_the_message_and_the_exception_text(captured: tuple[logging.Logger, io.StringIO]) -> None:
    logger, stream = captured
    try:
        raise ValueError("could not parse 'mallory@example.net'")
    except ValueError:
        logger.exception("failed for Bearer sk_demo_abcdefgh1234")
    out = stream.getvalue()
    assert "mallory@example.net" not in out and "sk_demo_abcdefgh1234" not in out
    assert "Traceback" in out and "ValueError: could not parse '[email]'" in out


def test_filter_keeps_the_record_and_leaves_clean_messages_alone(
    captured: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, stream = captured
    logger.info("batch of %d closed by %s", 32, "size")
    assert stream.getvalue() == "INFO batch of 32 closed by size\n"


def test_filter_scrubs_a_message_that_is_not_a_string(captured: tuple[logging.Logger, io.StringIO]) -> None:
    logger, stream = captured
    logger.error(ValueError("contact trent@example.com"))
    assert "trent@example.com" not in stream.getvalue()
