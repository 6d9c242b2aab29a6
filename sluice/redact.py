"""Redaction of user data before anything reaches a log line.

Inputs and outputs are never logged as they are: a log record carries their size and hash.
Free text that must be logged (error messages that may quote input) goes through `scrub`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from typing import Any

_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"(?i)bearer\s+[A-Za-z0-9._~+/=-]+"), "Bearer [key]"),
    (re.compile(r"\bsk_[A-Za-z0-9_-]{8,}"), "[key]"),
    (re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}"), "[email]"),
    (re.compile(r"\b(?:\d[ -]?){13,19}\b"), "[card]"),
    (re.compile(r"(?<!\w)\+?\d[\d ().-]{7,}\d\b"), "[phone]"),
)


def scrub(text: str) -> str:
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text


def fingerprint(value: Any) -> str:
    """A short, stable identity for a payload that reveals nothing of it."""
    blob = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str).encode()
    return f"sha256:{hashlib.sha256(blob).hexdigest()[:16]} len={len(blob)}"


class RedactingFilter(logging.Filter):
    """Last line of defence: scrub every formatted message and its arguments."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.args:
            record.msg = record.getMessage()
            record.args = None
        # A non-str message (an exception object, say) would be str()-ed later, unscrubbed.
        record.msg = scrub(str(record.msg))
        if record.exc_info and record.exc_info[1] is not None:
            record.exc_text = scrub(logging.Formatter().formatException(record.exc_info))
            record.exc_info = None
        return True

