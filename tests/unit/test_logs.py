"""JSON log lines: a maintained formatter, redaction in front of it, the request id bound per request."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from sluice.logs import accepted_request_id, bound_request_id, current_request_id, prepare_handler


@pytest.fixture
def captured() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    sink = io.StringIO()
    handler = logging.StreamHandler(sink)
    prepare_handler(handler, fmt="json", process="worker[m/v1]")
    logger = logging.getLogger(f"tests.logs.{id(sink)}")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    yield logger, sink
    logger.handlers.clear()


def _lines(sink: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in sink.getvalue().splitlines()]


def test_a_line_is_one_json_object_with_the_bound_request_id(captured: tuple[logging.Logger, io.StringIO]) -> None:
    logger, sink = captured
    with bound_request_id("trace-1"):
        assert current_request_id() == "trace-1"
        logger.info("batch of %d stored", 8, extra={"job_ids": ["job_a"], "batch_size": 8})
    logger.info("outside any request")
    inside, outside = _lines(sink)
    assert inside["message"] == "batch of 8 stored" and inside["level"] == "INFO"
    assert inside["request_id"] == "trace-1" and inside["job_ids"] == ["job_a"] and inside["batch_size"] == 8
    assert inside["process"] == "worker[m/v1]" and inside["logger"] == logger.name and "time" in inside
    assert "request_id" not in outside
    assert current_request_id() is None


def test_a_record_naming_its_own_request_id_keeps_it(captured: tuple[logging.Logger, io.StringIO]) -> None:
    logger, sink = captured
    with bound_request_id("the-request"):
        logger.warning("job failed", extra={"request_id": "the-job's"})
    assert _lines(sink)[0]["request_id"] == "the-job's"


def test_redaction_stays_in_front_of_the_json_formatter(captured: tuple[logging.Logger, io.StringIO]) -> None:
    logger, sink = captured
    try:
        raise ValueError("could not parse jane@example.com")
    except ValueError:
        logger.exception("input from %s refused", "jane@example.com")
    line = _lines(sink)[0]
    assert "jane@example.com" not in sink.getvalue()
    assert line["message"] == "input from [email] refused" and "[email]" in str(line["exc_info"])


@pytest.mark.parametrize("sent", ["trace-7f3a", "550e8400-e29b-41d4-a716-446655440000", "a" * 128, "svc:abc/1+2="])
def test_a_plain_token_is_kept(sent: str) -> None:
    assert accepted_request_id(sent) == sent


@pytest.mark.parametrize("sent", [None, "", "jane@example.com", "two words", "a" * 129, "-leading", "tab\there",
                                  "naïve"])
def test_anything_else_is_replaced_by_a_new_id(sent: str | None) -> None:
    made = accepted_request_id(sent)
    assert made.startswith("req_") and made != sent and len(made) == 28
