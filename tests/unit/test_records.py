"""Every record that crosses Redis round-trips through its one codec, as Redis hands it back
(bytes keys and values), and a reader never mistakes one record for another."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import pytest

from sluice.references import InputRef, OutputRef, Written
from sluice.wire import events
from sluice.wire.entries import DeadLetter, StreamEntry
from sluice.wire.heartbeats import LIVE_WITHIN_S, Heartbeat, WorkerState, live_since
from sluice.wire.idempotency import IdempotencyRecord
from sluice.wire.jobs import JobRecord, JobStatus, JobView
from sluice.wire.outbox import OutboxEntry
from sluice.wire.samples import Sample


def _as_redis(fields: Mapping[str, str]) -> dict[bytes, bytes]:
    return {key.encode(): value.encode() for key, value in fields.items()}


@pytest.mark.parametrize("shadow, shadow_of", [(None, None), ("v2", None), (None, "job_primary")])
def test_a_stream_entry_round_trips_and_carries_what_its_record_says(shadow: str | None,
                                                                       shadow_of: str | None) -> None:
    record = JobRecord(id="job_x", tenant="acme", model="m", version="v1", lane="online", status=JobStatus.queued,
                       input={"text": "secret"}, enqueued_at=1_700_000_000.123456, cost=17, shadow=shadow,
                       shadow_of=shadow_of)
    entry = StreamEntry.of(record)
    assert StreamEntry.from_fields(_as_redis(entry.to_fields())) == entry
    assert (entry.job_id, entry.tenant, entry.cost, entry.enqueued_at) == ("job_x", "acme", 17, record.enqueued_at)
    assert (entry.shadow, entry.shadow_of) == (shadow, shadow_of)
    assert (entry.run_timeout_s, entry.retry) == (None, None)
    limited = StreamEntry.of(replace(record, run_timeout_s=1.5, retry="3:run_timeout"))
    assert StreamEntry.from_fields(_as_redis(limited.to_fields())) == limited
    assert (limited.run_timeout_s, limited.retry) == (1.5, "3:run_timeout")
    # The entry is for batching: the input never rides in the stream.
    assert "secret" not in str(entry.to_fields())


def test_a_dead_letter_round_trips_and_keeps_its_error_short() -> None:
    letter = DeadLetter(job_id="job_x", error="boom " * 200, at=1_700_000_000.5)
    parsed = DeadLetter.from_fields(_as_redis(letter.to_fields()))
    assert (parsed.job_id, parsed.at) == ("job_x", letter.at)
    assert parsed.error == letter.error[:500]


@pytest.mark.parametrize("quality", [{}, {"size": 42, "top_p": 0.91, "label": "card_lost", "agreement": 1.0}])
def test_a_sample_round_trips(quality: dict[str, object]) -> None:
    sample = Sample(status="succeeded", finished_at=1_700_000_000.25, queue_wait_ms=3.5, model_ms=12.25,
                    total_ms=16.0, batch_size=8, close_reason="age", quality=quality)
    assert Sample.from_fields(_as_redis(sample.to_fields())) == sample
    assert sample.succeeded and not replace(sample, status="failed").succeeded


@pytest.mark.parametrize("precision, precision_speedup", [("", None), ("int8", 1.771), ("fp32", 0.912), ("fp32", None)])
def test_a_heartbeat_round_trips_from_bytes_or_str(precision: str, precision_speedup: float | None) -> None:
    beat = Heartbeat(state=WorkerState.ready, items_per_s=123.456, batch_size=32, cold_start_s=4.5, processed=99,
                     pid=4242, at=1_700_000_000.75, precision=precision, precision_speedup=precision_speedup,
                     backlog_items_per_s=456.789, held_online=7, held_bulk=96)
    assert Heartbeat.from_fields(_as_redis(beat.to_fields())) == beat
    assert Heartbeat.from_fields(beat.to_fields()) == beat
    assert live_since(100.0) == 100.0 - LIVE_WITHIN_S


def test_a_heartbeat_without_a_precision_reads_as_none_chosen() -> None:
    # Written by a worker from before the precision fields, during a rolling upgrade.
    fields = {"state": "ready", "items_per_s": "1.000", "batch_size": "1", "cold_start_s": "0.100",
              "processed": "0", "pid": "1", "at": "1.5"}
    beat = Heartbeat.from_fields(_as_redis(fields))
    assert (beat.precision, beat.precision_speedup) == ("", None)
    assert beat.backlog_items_per_s == 0.0  # nor a backlog rate: its plain rate stands in
    assert (beat.held_online, beat.held_bulk) == (0, 0)


@pytest.mark.parametrize("event", [
    events.JobChanged(id="job_x", status="succeeded"),
    events.RoutingChanged(model="intent"),
    events.KeyRevoked(key_hash="ab" * 32),
])
def test_an_event_round_trips(event: events.Sent) -> None:
    assert events.parse(events.encode(event)) == event
    assert events.parse(events.encode(event).encode()) == event


@pytest.mark.parametrize("data", [b"", b"not json", b"[]", b"{}", b'{"type":"job"}', b'{"type":"nope","id":"x"}',
                                  b'{"type":"routing"}', b"\xff\xfe"])
def test_an_unreadable_or_unknown_event_is_ignored(data: bytes) -> None:
    assert events.parse(data) is None


def test_the_routing_event_keeps_its_wire_form() -> None:
    # API replicas of the previous release parse exactly this during a rolling upgrade.
    assert events.encode(events.RoutingChanged(model="m")) == '{"type":"routing","model":"m"}'


def test_an_idempotency_record_round_trips_while_pending_and_done() -> None:
    for record in (IdempotencyRecord("h" * 64, None), IdempotencyRecord("h" * 64, ["job_a", "job_b"])):
        assert IdempotencyRecord.parse(record.encode()) == record


def test_an_outbox_entry_round_trips() -> None:
    entry = OutboxEntry(delivery_id="dlv_1", job_id="job_1")
    assert OutboxEntry.from_fields(_as_redis(entry.to_fields())) == entry
    assert OutboxEntry.from_fields({b"delivery": b"dlv_1"}) is None


def _submitted(**changes: Any) -> JobRecord:
    base: dict[str, Any] = dict(id="job_v", tenant="acme", model="m", version="v1", lane="online",
                                status=JobStatus.queued, input={"text": "caf\u00e9"}, enqueued_at=1_700_000_000.25)
    return JobRecord(**{**base, **changes})


@pytest.mark.parametrize("record", [
    _submitted(),
    _submitted(input={"text": "\u65e5\u672c \U0001f600"}, metadata={"k": "\u00fc", "f": 0.1, "n": None, "b": False}),
    _submitted(input={"tokens": 512}, lane="bulk", callback_url="https://example.com/h", deadline=1_700_000_060.5,
               shadow="v2", cost=512),
    # A request body may carry integers of up to 4300 digits.
    _submitted(metadata={"n": 10**40}),
    _submitted(input={}, input_ref=InputRef(uri="in/a.json", path="/r/tenants/acme/in/a.json", size=12,
                                            sha256="a" * 64),
               output_ref=OutputRef(uri="file:///r/tenants/acme/out/a.json", path="/r/tenants/acme/out/a.json")),
    _submitted(deadline=1_700_000_002.0, run_timeout_s=0.5, retry="2:worker_error,run_timeout"),
], ids=["plain", "unicode", "every-field", "big-integer", "by-reference", "limits"])
def test_a_job_record_round_trips_as_submitted(record: JobRecord) -> None:
    assert JobRecord.from_redis(_as_redis(record.to_redis())) == record


def _finished(record: JobRecord, *, status: str, output: str = "", error: str = "") -> dict[bytes, bytes]:
    """The hash as Redis hands it back once a worker's finish script wrote the outcome."""
    fields = {**record.to_redis(), "status": status, "started_at": "1700000000.5", "finished_at": "1700000001.0",
              "model_ms": "12.5", "batch_size": "3", "close_reason": "age", "attempts": "1"}
    if output:
        fields["output"] = output
    if error:
        fields["error"] = error
    return _as_redis(fields)


VIEWED = {
    "queued": _as_redis(_submitted().to_redis()),
    "metadata": _as_redis(_submitted(metadata={"a": 1, "b": "\u00fc", "c": True, "d": 1.5, "e": None}).to_redis()),
    # Request bodies may carry integers of up to 4300 digits; orjson alone writes none past 64 bits.
    "big-integer": _as_redis(_submitted(metadata={"n": 10**40}).to_redis()),
    "embedding": _finished(_submitted(), status="succeeded",
                           output=json.dumps({"embedding": [0.1, -2.5e-05, 1.0, 0.30000001192092896], "dim": 4},
                                             separators=(",", ":"))),
    "empty-output": _finished(_submitted(), status="succeeded", output="{}"),
    "label-named-NaN": _finished(_submitted(), status="succeeded", output='{"label":"NaN","scores":{"NaN":1.0}}'),
    "failed": _finished(_submitted(metadata={"k": "v"}), status="failed",
                        error='{"code":"inference_error","message":"boom"}'),
    "written": _finished(_submitted(input={}, input_ref=InputRef(uri="in/a.json", path="/p", size=3),
                                    output_ref=OutputRef(uri="out/a.json", path="/q"),
                                    written=Written(size=14, sha256="b" * 64), metadata={"k": "v"}),
                         status="succeeded"),
    # As the scripts leave a job retried once: its first attempt's error noted (cjson's spelling).
    "retried": _as_redis({**{k.decode(): v.decode() for k, v in _finished(
        _submitted(deadline=1_700_000_060.5, run_timeout_s=0.5, retry="2:run_timeout", metadata={"k": "v"}),
        status="failed", error='{"code":"run_timeout","message":"late again"}').items()},
        "attempt_errors": '[{"error":{"code":"run_timeout","message":"late"},"at":1700000000.75}]'}),
    # A job that woke its version from zero: the finish script adds its cold start to the timings.
    "cold-start": {**_finished(_submitted(), status="succeeded", output="{}"), b"cold_start_ms": b"2350.5"},
}


def test_a_job_by_reference_shows_its_uris_and_written_output_never_its_paths() -> None:
    resource = JobView.from_redis(VIEWED["written"]).body()
    body = json.loads(resource)
    assert (body["input_uri"], body["output_uri"], body["output_size"], body["output_sha256"]) == (
        "in/a.json", "out/a.json", 14, "b" * 64)
    assert "output" not in body and b'"/p"' not in resource and b'"/q"' not in resource


@pytest.mark.parametrize("raw", VIEWED.values(), ids=VIEWED.keys())
def test_a_job_view_answers_the_resource_of_the_stored_record(raw: dict[bytes, bytes]) -> None:
    record = JobRecord.from_redis(raw)
    view = JobView.from_redis(raw)
    # Compared as printed: the same keys in the same order, and an int stays an int.
    assert json.dumps(json.loads(view.body())) == json.dumps(record.resource())
    assert (view.id, view.tenant, view.status, view.is_final) == (record.id, record.tenant, record.status,
                                                                  record.is_final)


def test_cold_start_ms_is_in_the_timings_only_for_a_job_that_woke_its_version() -> None:
    woke = json.loads(JobView.from_redis(VIEWED["cold-start"]).body())
    assert woke["timings"]["cold_start_ms"] == 2350.5
    assert "cold_start_ms" not in json.loads(JobView.from_redis(VIEWED["empty-output"]).body())["timings"]


def test_a_job_view_answers_a_non_finite_output_number_as_null() -> None:
    """Python's encoder writes NaN and Infinity as bare words, which are not JSON: copied as they
    are, they would make the whole answer unreadable."""
    raw = _finished(_submitted(), status="succeeded", output='{"embedding":[NaN,1.0,-Infinity],"dim":3}')
    assert json.loads(JobView.from_redis(raw).body())["output"] == {"embedding": [None, 1.0, None], "dim": 3}
