"""The per-version response cache over the real API, Redis and `sluice worker` (ARCHITECTURE, "Response cache").

A hit is a job answered at submission: `succeeded`, `cache_hit: true`, the stored output, and no
stream entry, so no worker ever sees it. The cache is keyed on the tenant, the version and the
canonical input, so neither another tenant nor a new version is answered from an entry it did not
make. Hits and misses are counted on /metrics; entries expire with the version's TTL.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from sluice.wire import keys
from tests.support import FAST_SYNTHETIC, SYNTHETIC_SHA, lane_jobs, spawn_worker, unique, wait_job, wait_until

TTL_S = 300


def _register(admin: httpx.Client, prefix: str, *, versions: dict[str, int]) -> str:
    """A synthetic model whose versions (stable) have these cache TTLs; all traffic on the first."""
    name = unique(prefix)
    assert admin.post("/v1/models", json={"name": name, "kind": "synthetic"}).status_code == 201
    for version, ttl_s in versions.items():
        body: dict[str, Any] = {"version": version, "artifact": f"synthetic:?{FAST_SYNTHETIC}",
                                "sha256": SYNTHETIC_SHA, "state": "stable", "batching": {"max_wait_ms": 5.0}}
        if ttl_s:
            body["cache_ttl_s"] = ttl_s
        response = admin.post(f"/v1/models/{name}/versions", json=body)
        assert response.status_code == 201 and response.json()["cache_ttl_s"] == ttl_s, response.text
    first = next(iter(versions))
    assert admin.put(f"/v1/models/{name}/routing", json={"weights": {first: 100.0}}).status_code == 200
    return name


def _submit(client: httpx.Client, model: str, text: str, **options: Any) -> dict[str, Any]:
    response = client.post(f"/v1/models/{model}/jobs", json={"input": {"text": text}, **options})
    assert response.status_code == 202, response.text
    job: dict[str, Any] = response.json()
    return job


def _ran(client: httpx.Client, model: str, text: str) -> dict[str, Any]:
    """Submit and wait: a job its worker ran (not answered from the cache)."""
    job = wait_job(client, _submit(client, model, text)["id"])
    assert job["status"] == "succeeded" and job["cache_hit"] is False, job
    return job


def _hit(client: httpx.Client, model: str, text: str, **options: Any) -> dict[str, Any]:
    job = _submit(client, model, text, **options)
    assert job["status"] == "succeeded" and job["cache_hit"] is True, job
    return job


@pytest.fixture(scope="module")
def cached(admin: httpx.Client, api: Any, redis_url: str, database_url: str, home: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """v1 and v2 cache for TTL_S; v1 takes the traffic and has a worker, v2 has neither."""
    name = _register(admin, "cached", versions={"v1": TTL_S, "v2": TTL_S})
    worker = spawn_worker(redis_url=redis_url, database_url=database_url, home=home, model=name,
                          log_path=tmp_path_factory.mktemp("worker") / "worker.log")
    yield name
    assert worker.terminate() == 0, worker.log()


def test_a_repeated_input_is_answered_at_once_and_never_reaches_a_worker(
    cached: str, demo: httpx.Client, rds: redis.Redis
) -> None:
    first = _ran(demo, cached, "the same question")
    cache_key = rds.hget(keys.job(first["id"]), "cache_key")
    assert cache_key and cache_key.startswith(f"sluice:cache:{keys.tag(cached, 'v1')}:")
    assert 0 < rds.ttl(cache_key) <= TTL_S  # type: ignore[operator]
    stream = keys.stream(cached, "v1", "online")
    last_entry = rds.xinfo_stream(stream)["last-generated-id"]  # type: ignore[index]
    samples = rds.xlen(keys.stats(cached, "v1"))

    second = _hit(demo, cached, "the same question")
    assert second["id"] != first["id"] and second["output"] == first["output"]
    assert second["attempts"] == 0 and second["batch"] == {"size": None, "close_reason": None}
    assert second["timings"]["queue_wait_ms"] == 0 and second["timings"]["model_ms"] is None
    assert demo.get(f"/v1/jobs/{second['id']}").json() == second
    # No entry was added, and no worker took it: no claim, no sample of a finished batch.
    assert rds.xinfo_stream(stream)["last-generated-id"] == last_entry  # type: ignore[index]
    assert rds.hget(keys.job(second["id"]), "worker") is None
    assert rds.xlen(keys.stats(cached, "v1")) == samples


def test_another_tenant_and_another_version_are_never_answered_from_the_entry(
    cached: str, demo: httpx.Client, new_tenant: Callable[..., tuple[str, httpx.Client]], rds: redis.Redis
) -> None:
    _ran(demo, cached, "whose answer is this")
    _, other = new_tenant("cache")
    theirs = _ran(other, cached, "whose answer is this")
    assert theirs["output"] == {"echo": {"text": "whose answer is this"}}

    newer = _submit(demo, cached, "whose answer is this", version="v2")
    assert newer["status"] == "queued" and newer["cache_hit"] is False
    assert rds.hget(keys.job(newer["id"]), "cache_key").startswith(f"sluice:cache:{keys.tag(cached, 'v2')}:")
    assert lane_jobs(rds, cached, "v2", "online") >= 1


def test_a_failed_job_leaves_nothing_in_the_cache(cached: str, demo: httpx.Client, rds: redis.Redis) -> None:
    failed = wait_job(demo, _submit(demo, cached, "__poison__")["id"])
    assert failed["status"] == "failed", failed
    assert not rds.exists(rds.hget(keys.job(failed["id"]), "cache_key"))  # type: ignore[arg-type]
    assert _submit(demo, cached, "__poison__")["cache_hit"] is False


def test_a_bulk_submission_mixing_hits_and_misses_answers_every_id_in_input_order_and_replays_them(
    cached: str, demo: httpx.Client, rds: redis.Redis
) -> None:
    _ran(demo, cached, "bulk a")
    _ran(demo, cached, "bulk c")
    texts = ["bulk a", "bulk b", "bulk c", "bulk d"]
    key = unique("cache-bulk")
    body = {"inputs": [{"text": text} for text in texts], "lane": "online"}
    response = demo.post(f"/v1/models/{cached}/jobs:bulk", json=body, headers={"Idempotency-Key": key})
    assert response.status_code == 202 and response.json()["count"] == 4, response.text
    ids = response.json()["ids"]
    at_once = [demo.get(f"/v1/jobs/{job_id}").json() for job_id in ids]
    assert [job["cache_hit"] for job in at_once] == [True, False, True, False]
    assert [job["status"] for job in at_once[::2]] == ["succeeded", "succeeded"]
    done = [wait_job(demo, job_id) for job_id in ids]
    assert [job["output"] for job in done] == [{"echo": {"text": text}} for text in texts]

    replay = demo.post(f"/v1/models/{cached}/jobs:bulk", json=body, headers={"Idempotency-Key": key})
    assert replay.status_code == 202 and replay.headers["Idempotent-Replayed"] == "true"
    assert replay.json()["ids"] == ids

    # Every job a hit: the script that writes them completes the key itself.
    key = unique("cache-hits")
    hits = {"inputs": [{"text": "bulk d"}, {"text": "bulk b"}], "lane": "online"}
    first = demo.post(f"/v1/models/{cached}/jobs:bulk", json=hits, headers={"Idempotency-Key": key})
    assert first.status_code == 202, first.text
    assert [demo.get(f"/v1/jobs/{job_id}").json()["cache_hit"] for job_id in first.json()["ids"]] == [True, True]
    again = demo.post(f"/v1/models/{cached}/jobs:bulk", json=hits, headers={"Idempotency-Key": key})
    assert again.json()["ids"] == first.json()["ids"] and again.headers["Idempotent-Replayed"] == "true"


def test_submit_and_wait_on_a_hit_answers_200_at_once(cached: str, demo: httpx.Client) -> None:
    _ran(demo, cached, "wait for it")
    started = time.monotonic()
    response = demo.post(f"/v1/models/{cached}/jobs", params={"wait": 10}, json={"input": {"text": "wait for it"}})
    assert response.status_code == 200 and response.json()["cache_hit"] is True, response.text
    assert time.monotonic() - started < 1.0


def test_a_hit_with_a_callback_url_queues_its_webhook(cached: str, demo: httpx.Client, rds: redis.Redis) -> None:
    _ran(demo, cached, "call me back")
    job = _hit(demo, cached, "call me back", callback_url="https://hooks.example.com/cache")
    delivery = rds.hget(keys.job(job["id"]), "delivery_id")
    assert delivery
    queued = [(entry_id, fields) for entry_id, fields in rds.xrange(keys.outbox(cached, "v1"))  # type: ignore[union-attr]
              if fields.get("job") == job["id"]]
    assert [fields["delivery"] for _, fields in queued] == [delivery]
    # Nobody is there to receive it: the entry goes before a relay of a later test could send it.
    rds.xdel(keys.outbox(cached, "v1"), *(entry_id for entry_id, _ in queued))


def _lookups(anon: httpx.Client, model: str) -> dict[str, float]:
    families = text_string_to_metric_families(anon.get("/metrics").text)
    return {sample.labels["result"]: sample.value for family in families if family.name == "sluice_cache_lookups"
            for sample in family.samples if sample.name == "sluice_cache_lookups_total"
            and (sample.labels["model"], sample.labels["version"]) == (model, "v1")}


def test_hits_and_misses_are_counted_on_metrics(cached: str, demo: httpx.Client, anon: httpx.Client) -> None:
    before = _lookups(anon, cached)
    _ran(demo, cached, "count me")
    _hit(demo, cached, "count me")
    after = _lookups(anon, cached)
    assert after["hit"] - before.get("hit", 0) == 1 and after["miss"] - before.get("miss", 0) == 1


def test_caching_is_off_by_default_and_a_patch_turns_it_on_and_off_audited(
    admin: httpx.Client, demo: httpx.Client, start_worker: Callable[..., Any], rds: redis.Redis
) -> None:
    model = _register(admin, "uncached", versions={"v1": 0})
    start_worker(model)
    for _ in range(2):
        job = _ran(demo, model, "ask twice")
        assert rds.hget(keys.job(job["id"]), "cache_key") is None
    assert not list(rds.scan_iter(match=f"sluice:cache:{keys.tag(model, 'v1')}:*"))

    for bad in (-1, 31 * 24 * 3600):
        assert admin.patch(f"/v1/models/{model}/versions/v1", json={"cache_ttl_s": bad}).status_code == 422
        assert admin.post(f"/v1/models/{model}/versions", json={
            "version": "v9", "artifact": "synthetic:", "sha256": SYNTHETIC_SHA, "cache_ttl_s": bad}).status_code == 422
    patched = admin.patch(f"/v1/models/{model}/versions/v1", json={"cache_ttl_s": 60, "reason": "cache it"})
    assert patched.status_code == 200, patched.text
    audit = patched.json()["audit"]
    assert patched.json()["cache_ttl_s"] == 60
    assert (audit["action"], audit["before"]["cache_ttl_s"], audit["after"]["cache_ttl_s"], audit["reason"]) == (
        "version.update", 0, 60, "cache it")
    assert admin.get(f"/v1/models/{model}").json()["versions"][0]["cache_ttl_s"] == 60
    assert admin.get(f"/v1/models/{model}/audit").json()["entries"][0]["id"] == audit["id"]

    _ran(demo, model, "ask twice")
    _hit(demo, model, "ask twice")
    assert admin.patch(f"/v1/models/{model}/versions/v1", json={"cache_ttl_s": 0}).status_code == 200
    # Off at once, though the entry is still there.
    _ran(demo, model, "ask twice")


def test_an_entry_expires_with_its_ttl(
    admin: httpx.Client, demo: httpx.Client, start_worker: Callable[..., Any], rds: redis.Redis
) -> None:
    model = _register(admin, "brief", versions={"v1": 1})
    start_worker(model)
    job = _ran(demo, model, "soon forgotten")
    cache_key = rds.hget(keys.job(job["id"]), "cache_key")
    assert rds.ttl(cache_key) in (0, 1)  # type: ignore[arg-type]
    wait_until(lambda: not rds.exists(cache_key), timeout_s=5, what="the entry to expire")  # type: ignore[arg-type]
    _ran(demo, model, "soon forgotten")
