"""Every rejection the REST API documents, over the real API: the right status, the error envelope, and
nothing queued (no stream entry, no job record). Also the happy paths of submit, read, cancel.

The model under test is a synthetic one registered per module (v1 takes all traffic, v2 is
stable with no weight), so nothing here queues work on the demo models; no worker runs for it,
so every job submitted here stays `queued`.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from sluice.settings import Settings
from sluice.wire import keys

Snapshot = Callable[[str, str], Any]


def unique(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


@pytest.fixture(scope="module")
def model(register_synthetic: Callable[..., str]) -> str:
    return register_synthetic("rej", versions=("v1", "v2"), weights={"v1": 100.0})


@pytest.fixture
def nothing_queued(queue_state: Snapshot) -> Callable[..., Any]:
    """Context manager: the versions' streams and the job records are unchanged inside it."""

    @contextmanager
    def check(model: str, versions: tuple[str, ...] = ("v1", "v2")) -> Iterator[None]:
        before = {v: queue_state(model, v) for v in versions}
        yield
        assert {v: queue_state(model, v) for v in versions} == before

    return check


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, str]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"code", "message"}, body
    assert isinstance(error["message"], str) and error["message"], body
    assert "Traceback" not in error["message"]
    if code is not None:
        assert error["code"] == code, body
    return dict(error)


def submit(client: httpx.Client, model: str, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
    return client.post(f"/v1/models/{model}/jobs", json=body, **kwargs)


# --- 401 ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("authorization", [
    None,
    "Token sk_demo_abc",
    "Bearer",
    "Basic ZGVtbzpkZW1v",
    "Bearer sk_unknown_0123456789abcdefghijklmnop",
], ids=["no-header", "wrong-scheme", "empty-bearer", "basic", "unknown-key"])
def test_401_without_a_valid_key(
    anon: httpx.Client, model: str, nothing_queued: Callable[..., Any], authorization: str | None
) -> None:
    headers = {"Authorization": authorization} if authorization is not None else {}
    with nothing_queued(model):
        response = submit(anon, model, {"input": {"text": "hello"}}, headers=headers)
        assert_error(response, 401, "unauthenticated")
    assert_error(anon.get("/v1/models", headers=headers), 401, "unauthenticated")


def test_401_after_the_key_is_revoked(
    admin: httpx.Client, client_for: Callable[[str], httpx.Client], model: str,
    nothing_queued: Callable[..., Any],
) -> None:
    issued = admin.post("/v1/tenants/demo/keys", json={})
    assert issued.status_code == 201, issued.text
    key = issued.json()
    client = client_for(key["secret"])
    assert client.get("/v1/models").status_code == 200  # valid, and now in the API's auth cache

    revoked = admin.delete(f"/v1/keys/{key['id']}")
    assert revoked.status_code == 200, revoked.text
    with nothing_queued(model):
        assert_error(submit(client, model, {"input": {"text": "hello"}}), 401, "unauthenticated")
    assert_error(client.get("/v1/models"), 401, "unauthenticated")
    assert_error(admin.delete(f"/v1/keys/{key['id']}"), 404, "not_found")


# --- 403 ------------------------------------------------------------------------------------------


def test_403_for_a_plain_key_on_admin_routes(demo: httpx.Client, admin: httpx.Client, model: str) -> None:
    assert_error(demo.post("/v1/models", json={"name": unique("nope"), "kind": "synthetic"}), 403, "forbidden")
    assert_error(demo.put(f"/v1/models/{model}/routing", json={"weights": {"v2": 100}}), 403, "forbidden")
    assert_error(demo.post(f"/v1/models/{model}/versions", json={
        "version": "v9", "artifact": "synthetic:?fixed_s=0", "sha256": "0" * 64}), 403, "forbidden")
    assert_error(demo.post("/v1/tenants", json={"id": unique("nope")}), 403, "forbidden")
    assert_error(demo.put(f"/v1/tenants/demo/pins/{model}", json={"version": "v2"}), 403, "forbidden")
    # Nothing changed behind the refusals.
    resource = admin.get(f"/v1/models/{model}").json()
    assert resource["routing"] == {"v1": 100.0}
    assert [v["version"] for v in resource["versions"]] == ["v1", "v2"]


def test_403_for_a_pinned_tenant_asking_for_another_version(
    admin: httpx.Client, new_tenant: Callable[..., tuple[str, httpx.Client]], model: str,
    nothing_queued: Callable[..., Any],
) -> None:
    tenant, client = new_tenant("pinned")
    pinned = admin.put(f"/v1/tenants/{tenant}/pins/{model}", json={"version": "v1"})
    assert pinned.status_code == 200, pinned.text
    with nothing_queued(model):
        error = assert_error(submit(client, model, {"input": {"text": "x"}, "version": "v2"}), 403, "forbidden")
    assert "pinned" in error["message"]


# --- 404 ------------------------------------------------------------------------------------------


def test_404_for_an_unknown_model(demo: httpx.Client, queue_state: Snapshot) -> None:
    name = unique("missing")
    before = queue_state(name, "v1")
    assert_error(submit(demo, name, {"input": {"text": "x"}}), 404, "not_found")
    assert_error(demo.post(f"/v1/models/{name}/jobs:bulk", json={"inputs": [{"text": "x"}]}), 404, "not_found")
    assert_error(demo.get(f"/v1/models/{name}"), 404, "not_found")
    assert queue_state(name, "v1") == before


def test_404_for_an_unknown_explicit_version(
    demo: httpx.Client, model: str, nothing_queued: Callable[..., Any]
) -> None:
    with nothing_queued(model, ("v1", "v2", "v3")):
        assert_error(submit(demo, model, {"input": {"text": "x"}, "version": "v3"}), 404, "not_found")


def test_404_for_stats_of_an_unknown_version(admin: httpx.Client, model: str) -> None:
    assert admin.get(f"/v1/models/{model}/versions/v1/stats").status_code == 200
    assert_error(admin.get(f"/v1/models/{unique('missing')}/versions/v1/stats"), 404, "not_found")
    assert_error(admin.get(f"/v1/models/{model}/versions/v9/stats"), 404, "not_found")


@pytest.mark.parametrize("job_id", ["job_AAAAAAAAAAAAAAAAAAAAAA", "not-a-job-id"])
def test_404_for_an_unknown_job(demo: httpx.Client, job_id: str) -> None:
    assert_error(demo.get(f"/v1/jobs/{job_id}"), 404, "not_found")
    assert_error(demo.get(f"/v1/jobs/{job_id}", params={"wait": 0.2}), 404, "not_found")
    assert_error(demo.delete(f"/v1/jobs/{job_id}"), 404, "not_found")


def test_404_for_another_tenants_job(
    demo: httpx.Client, new_tenant: Callable[..., tuple[str, httpx.Client]], model: str
) -> None:
    _, other = new_tenant("other")
    created = submit(other, model, {"input": {"text": "mine"}})
    assert created.status_code == 202, created.text
    job_id = created.json()["id"]

    missing = assert_error(demo.get(f"/v1/jobs/{job_id}"), 404, "not_found")
    # Exactly what a job that never existed answers: nothing leaks its existence.
    never = assert_error(demo.get("/v1/jobs/job_AAAAAAAAAAAAAAAAAAAAAA"), 404, "not_found")
    assert missing["message"].replace(job_id, "ID") == never["message"].replace("job_AAAAAAAAAAAAAAAAAAAAAA", "ID")
    assert_error(demo.get(f"/v1/jobs/{job_id}/events"), 404, "not_found")
    assert_error(demo.delete(f"/v1/jobs/{job_id}"), 404, "not_found")
    # The owner still sees it, untouched by the other tenant's cancel attempt.
    assert other.get(f"/v1/jobs/{job_id}").json()["status"] == "queued"


# --- 409 ------------------------------------------------------------------------------------------


def test_409_for_an_idempotency_key_reused_with_another_body(
    demo: httpx.Client, model: str, nothing_queued: Callable[..., Any]
) -> None:
    key = {"Idempotency-Key": unique("idem")}
    first = submit(demo, model, {"input": {"text": "first body"}}, headers=key)
    assert first.status_code == 202, first.text
    with nothing_queued(model):
        assert_error(submit(demo, model, {"input": {"text": "another body"}}, headers=key), 409, "conflict")
        assert_error(submit(demo, model, {"input": {"text": "first body"}, "lane": "bulk"}, headers=key),
                     409, "conflict")


def test_409_for_an_explicit_retired_version(
    admin: httpx.Client, demo: httpx.Client, register_synthetic: Callable[..., str],
    nothing_queued: Callable[..., Any],
) -> None:
    name = register_synthetic("retiring", versions=("v1", "v2"), weights={"v1": 100.0})
    retired = admin.patch(f"/v1/models/{name}/versions/v2", json={"state": "retired", "reason": "test"})
    assert retired.status_code == 200, retired.text
    with nothing_queued(name):
        error = assert_error(submit(demo, name, {"input": {"text": "x"}, "version": "v2"}), 409, "conflict")
    assert "retired" in error["message"]


# --- 413 ------------------------------------------------------------------------------------------


def test_413_for_a_body_over_the_limit(
    demo: httpx.Client, model: str, settings: Settings, nothing_queued: Callable[..., Any]
) -> None:
    with nothing_queued(model):
        response = submit(demo, model, {"input": {"text": "a" * settings.max_body_bytes}})
        assert_error(response, 413, "payload_too_large")


def test_413_for_a_chunked_body_over_the_limit(
    demo: httpx.Client, model: str, settings: Settings, nothing_queued: Callable[..., Any]
) -> None:
    chunk = b'{"input": {"text": "' + b"a" * 16_384
    pieces = [chunk] + [b"a" * 16_384] * (settings.max_body_bytes // 16_384 + 1) + [b'"}}']
    with nothing_queued(model):
        response = demo.post(f"/v1/models/{model}/jobs", content=iter(pieces),
                             headers={"Content-Type": "application/json"})
        assert "content-length" not in {k.lower() for k in response.request.headers}
        assert_error(response, 413, "payload_too_large")


def test_413_for_a_bulk_over_max_items(
    demo: httpx.Client, model: str, settings: Settings, nothing_queued: Callable[..., Any]
) -> None:
    with nothing_queued(model):
        response = demo.post(f"/v1/models/{model}/jobs:bulk",
                             json={"inputs": [{"tokens": 1}] * (settings.max_bulk_items + 1)})
        assert_error(response, 413, "payload_too_large")


# --- 422 ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("body", [
    pytest.param({}, id="missing-input"),
    pytest.param({"input": None}, id="null-input"),
    pytest.param({"input": "hello"}, id="input-not-an-object"),
    pytest.param({"input": {"text": 5}}, id="text-not-a-string"),
    pytest.param({"input": {"tokens": "5"}}, id="tokens-not-an-int"),
    pytest.param({"input": {"tokens": True}}, id="tokens-a-bool"),
    pytest.param({"input": {"text": "a", "tokens": 3}}, id="text-and-tokens"),
    pytest.param({"input": {}}, id="empty-input"),
    pytest.param({"input": {"text": "a", "extra": 1}}, id="extra-input-field"),
    pytest.param({"input": {"text": "a"}, "priority": "high"}, id="extra-body-field"),
    pytest.param({"input": {"text": ""}}, id="empty-text"),
    pytest.param({"input": {"text": " \n\t "}}, id="blank-text"),
    pytest.param({"input": {"text": "TOO_LONG"}}, id="text-too-long"),
    pytest.param({"input": {"text": "a"}, "lane": "express"}, id="bad-lane"),
    pytest.param({"input": {"text": "a"}, "timeout_s": -1}, id="negative-timeout"),
    pytest.param({"input": {"text": "a"}, "timeout_s": 0}, id="zero-timeout"),
    pytest.param({"input": {"text": "a"}, "callback_url": "not a url"}, id="bad-callback"),
    pytest.param({"input": {"text": "a"}, "metadata": {"k": {"nested": 1}}}, id="nested-metadata"),
])
def test_422_for_an_invalid_submission(
    demo: httpx.Client, model: str, settings: Settings, nothing_queued: Callable[..., Any], body: dict[str, Any]
) -> None:
    if body.get("input") == {"text": "TOO_LONG"}:
        body = {"input": {"text": "a" * (settings.max_text_chars + 1)}}
    with nothing_queued(model):
        assert_error(submit(demo, model, body), 422)


def test_422_for_malformed_json(demo: httpx.Client, model: str, nothing_queued: Callable[..., Any]) -> None:
    with nothing_queued(model):
        response = demo.post(f"/v1/models/{model}/jobs", content=b'{"input": {"text": ',
                             headers={"Content-Type": "application/json"})
        assert_error(response, 422)


@pytest.mark.parametrize("text", ["", "   "], ids=["empty", "blank"])
def test_422_for_empty_text_on_an_embedding_model(
    demo: httpx.Client, seeded: object, nothing_queued: Callable[..., Any], text: str
) -> None:
    with nothing_queued("minilm", ("v1",)):
        error = assert_error(submit(demo, "minilm", {"input": {"text": text}}), 422, "invalid_input")
    assert "text" in error["message"]


def test_422_for_a_bulk_with_one_bad_input_queues_none_of_it(
    demo: httpx.Client, model: str, nothing_queued: Callable[..., Any]
) -> None:
    inputs: list[Any] = [{"text": f"good {i}"} for i in range(10)]
    inputs[6] = {"text": 42}
    with nothing_queued(model):
        error = assert_error(demo.post(f"/v1/models/{model}/jobs:bulk", json={"inputs": inputs}),
                             422, "invalid_input")
        assert "inputs[6]" in error["message"]
        assert_error(demo.post(f"/v1/models/{model}/jobs:bulk", json={"inputs": []}), 422)


# --- 503 ------------------------------------------------------------------------------------------


def test_503_when_the_model_has_no_routing_weight(
    demo: httpx.Client, register_synthetic: Callable[..., str], nothing_queued: Callable[..., Any]
) -> None:
    name = register_synthetic("noweight", weights={})
    with nothing_queued(name, ("v1",)):
        assert_error(submit(demo, name, {"input": {"text": "x"}}), 503, "no_servable_version")
        assert_error(demo.post(f"/v1/models/{name}/jobs:bulk", json={"inputs": [{"text": "x"}]}),
                     503, "no_servable_version")
        assert_error(demo.post("/v1/batches", json={"model": name, "inputs": [{"text": "x"}]}),
                     503, "no_servable_version")


# --- happy paths ------------------------------------------------------------------------------------


def test_submit_answers_202_with_location_and_the_queued_job(
    demo: httpx.Client, model: str, queue_state: Snapshot
) -> None:
    before = queue_state(model, "v1")
    response = submit(demo, model, {"input": {"text": "hello world"}, "metadata": {"order": 7}})
    assert response.status_code == 202, response.text
    job = response.json()
    assert job["id"].startswith("job_")
    assert response.headers["location"] == f"/v1/jobs/{job['id']}"
    assert job["status"] == "queued"
    assert (job["model"], job["version"], job["lane"]) == (model, "v1", "online")
    assert job["metadata"] == {"order": 7}
    assert job["cache_hit"] is False
    assert job["timings"]["enqueued_at"] is not None
    assert job["timings"]["started_at"] is None and job["timings"]["total_ms"] is None
    assert "output" not in job and "error" not in job
    after = queue_state(model, "v1")
    assert (after.online, after.bulk, after.jobs) == (before.online + 1, before.bulk, before.jobs + 1)

    fetched = demo.get(response.headers["location"])
    assert fetched.status_code == 200
    # Read back while queued, it also says where it stands (the 202 cannot: the script numbers it).
    read = fetched.json()
    assert read.pop("queue_position") >= 0 and "estimated_start_s" in read
    read.pop("estimated_start_s")
    assert read == job


def test_bulk_lane_and_explicit_version_go_to_their_stream(
    demo: httpx.Client, model: str, queue_state: Snapshot
) -> None:
    before = queue_state(model, "v2")
    response = submit(demo, model, {"input": {"tokens": 12}, "lane": "bulk", "version": "v2"})
    assert response.status_code == 202, response.text
    assert (response.json()["version"], response.json()["lane"]) == ("v2", "bulk")
    after = queue_state(model, "v2")
    assert (after.online, after.bulk) == (before.online, before.bulk + 1)


def test_bulk_submit_queues_every_input(demo: httpx.Client, model: str, queue_state: Snapshot) -> None:
    before = queue_state(model, "v1")
    response = demo.post(f"/v1/models/{model}/jobs:bulk",
                         json={"inputs": [{"text": f"item {i}"} for i in range(25)]})
    assert response.status_code == 202, response.text
    body = response.json()
    assert (body["count"], body["model"], body["version"]) == (25, model, "v1")
    assert len(set(body["ids"])) == 25
    # A bulk submission goes to the bulk lane unless it says otherwise (ARCHITECTURE, "Lanes").
    assert queue_state(model, "v1").bulk == before.bulk + 25
    assert demo.get(f"/v1/jobs/{body['ids'][-1]}").json()["status"] == "queued"


def test_idempotency_key_replay_answers_the_same_job_and_queues_one(
    demo: httpx.Client, model: str, queue_state: Snapshot
) -> None:
    before = queue_state(model, "v1")
    key = {"Idempotency-Key": unique("idem")}
    body = {"input": {"text": "exactly once"}}
    first = submit(demo, model, body, headers=key)
    second = submit(demo, model, body, headers=key)
    assert first.status_code == second.status_code == 202
    assert first.json()["id"] == second.json()["id"]
    assert second.headers.get("idempotent-replayed") == "true"
    assert "idempotent-replayed" not in first.headers
    after = queue_state(model, "v1")
    assert (after.online, after.jobs) == (before.online + 1, before.jobs + 1)

    # The key is per tenant body and per endpoint: the bulk replay answers the same ids too.
    bulk_key = {"Idempotency-Key": unique("idem-bulk")}
    bulk = {"inputs": [{"text": "a"}, {"text": "b"}]}
    ids = [demo.post(f"/v1/models/{model}/jobs:bulk", json=bulk, headers=bulk_key).json()["ids"] for _ in range(2)]
    assert ids[0] == ids[1]
    assert queue_state(model, "v1").bulk == after.bulk + 2


def test_cancel_a_queued_job(demo: httpx.Client, model: str, rds: Any) -> None:
    job = submit(demo, model, {"input": {"text": "cancel me"}}).json()
    response = demo.delete(f"/v1/jobs/{job['id']}")
    assert response.status_code == 200, response.text
    cancelled = response.json()
    assert cancelled["id"] == job["id"] and cancelled["status"] == "cancelled"
    assert cancelled["timings"]["finished_at"] is not None
    assert demo.get(f"/v1/jobs/{job['id']}").json()["status"] == "cancelled"
    assert rds.hget(keys.job(job["id"]), "status") == "cancelled"


def test_cancelling_twice_is_409(demo: httpx.Client, model: str) -> None:
    job = submit(demo, model, {"input": {"text": "cancel me twice"}}).json()
    assert demo.delete(f"/v1/jobs/{job['id']}").status_code == 200
    assert_error(demo.delete(f"/v1/jobs/{job['id']}"), 409, "conflict")


def test_healthz_and_readyz(anon: httpx.Client) -> None:
    health = anon.get("/healthz")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    ready = anon.get("/readyz")
    assert ready.status_code == 200
    body = ready.json()
    assert body["status"] == "ok"
    assert {"redis", "postgres", "routing", "events"} <= set(body["checks"])
    assert all(value == "ok" for value in body["checks"].values()), body
