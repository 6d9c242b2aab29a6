"""The response cache's names and the record of a job it answers (sluice/wire/response_cache.py)."""

from __future__ import annotations

import json

import orjson

from sluice.wire import keys
from sluice.wire.jobs import JobRecord, JobStatus, JobView
from sluice.wire.response_cache import answered, cache_keys, digest


def _queued() -> JobRecord:
    return JobRecord(id="job_c", tenant="acme", model="m", version="v1", lane="online", status=JobStatus.queued,
                     input={"text": "hello"}, enqueued_at=1_700_000_000.25, cost=3,
                     callback_url="https://example.com/h", shadow="v2",
                     cache_key=keys.cache("m", "v1", "d" * 64), cache_ttl_s=60)


def test_a_digest_is_the_tenant_s_and_the_input_s_whatever_the_key_order() -> None:
    assert digest("acme", {"a": 1, "b": "x"}) == digest("acme", {"b": "x", "a": 1})
    assert digest("acme", {"text": "hi"}) != digest("globex", {"text": "hi"})
    assert digest("acme", {"text": "hi"}) != digest("acme", {"text": "hi "})


def test_each_version_has_its_own_names_for_one_input() -> None:
    [v1] = cache_keys("m", "v1", "acme", [{"text": "hi"}])
    [v2] = cache_keys("m", "v2", "acme", [{"text": "hi"}])
    assert v1 != v2 and v1.startswith("sluice:cache:{m:v1}:") and v2.startswith("sluice:cache:{m:v2}:")


def test_a_cached_answer_is_final_at_once_with_no_queue_wait_model_time_or_batch() -> None:
    record = answered(_queued(), b'{"echo":{"text":"hello"}}', at=1_700_000_000.75)
    assert record.status is JobStatus.succeeded and record.cache_hit
    assert record.output == {"echo": {"text": "hello"}}
    # Nothing left for a worker to do: no copy to make, no output to store.
    assert (record.shadow, record.cache_key, record.cache_ttl_s) == (None, None, 0)
    timings = record.resource()["timings"]
    assert (timings["queue_wait_ms"], timings["model_ms"], timings["total_ms"]) == (0.0, None, 500.0)
    assert record.resource()["batch"] == {"size": None, "close_reason": None}


def test_both_records_round_trip_and_the_cache_fields_never_reach_the_resource() -> None:
    for record in (_queued(), answered(_queued(), b'{"echo":{"text":"hello"}}', at=1_700_000_000.75)):
        raw = {name.encode(): value.encode() for name, value in record.to_redis().items()}
        assert JobRecord.from_redis(raw) == record
        body = JobView.from_redis(raw).body()
        assert json.loads(body) == json.loads(orjson.dumps(record.resource()))
        assert b"cache_key" not in body and b"sluice:cache" not in body
