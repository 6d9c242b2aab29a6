"""One tenant can neither see nor touch another's jobs, nor learn that they exist.

Another tenant's job must answer exactly as a job that does not exist: same status, same body
shape and code, the same message once the id is taken out, the same headers. Job ids are
unguessable: `job_`, the four characters naming the version's slot (`sluice.wire.keys`; public, derived
from the version), a dot, and 22 URL-safe characters (128 random bits).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import redis

from sluice.wire import keys
from sluice.wire.keys import new_job_id

ID_PATTERN = re.compile(r"^job_[0-9a-z]{4}\.[A-Za-z0-9_-]{22}$")
# Headers that legitimately differ between two answers (sizes differ with the id's length only).
VARYING_HEADERS = {"date", "content-length"}


def _shape(response: httpx.Response, job_id: str) -> dict[str, Any]:
    """What a caller can observe of an answer, with the id it asked about taken out."""
    return {
        "status": response.status_code,
        "body": response.text.replace(job_id, "<id>"),
        "headers": sorted((k.lower(), v) for k, v in response.headers.items() if k.lower() not in VARYING_HEADERS),
    }


@pytest.fixture
def two_tenants(
    new_tenant: Callable[..., tuple[str, httpx.Client]], register_synthetic: Callable[..., str],
) -> tuple[str, httpx.Client, httpx.Client, str]:
    """A model, tenant A with one queued job on it (no worker runs it), and tenant B."""
    model = register_synthetic("tenancy")
    _, owner = new_tenant("owner")
    _, other = new_tenant("other")
    response = owner.post(f"/v1/models/{model}/jobs", json={"input": {"text": "private"}})
    assert response.status_code == 202, response.text
    return model, owner, other, response.json()["id"]


def test_another_tenants_job_answers_exactly_like_a_missing_one(
    two_tenants: tuple[str, httpx.Client, httpx.Client, str], rds: redis.Redis,
) -> None:
    _, owner, other, job_id = two_tenants
    missing = new_job_id("minilm", "v1")
    assert owner.get(f"/v1/jobs/{job_id}").status_code == 200  # it exists, for its owner

    probes: list[tuple[str, str, dict[str, Any]]] = [
        ("GET", "/v1/jobs/{id}", {}),
        ("GET", "/v1/jobs/{id}", {"params": {"wait": 1}}),
        ("GET", "/v1/jobs/{id}/events", {}),
        ("DELETE", "/v1/jobs/{id}", {}),
    ]
    for method, template, options in probes:
        # One request id for both: the API answers each request's id, the same one or a new one.
        same = {"X-Request-Id": "probe"}
        foreign = other.request(method, template.format(id=job_id), headers=same, **options)
        absent = other.request(method, template.format(id=missing), headers=same, **options)
        assert foreign.status_code == 404, (method, template, foreign.text)
        body = foreign.json()
        assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}, body
        assert body["error"]["code"] == "not_found", body
        assert _shape(foreign, job_id) == _shape(absent, missing), (method, template)

    # The cancel attempt changed nothing: the job is still queued, for its owner.
    assert rds.hget(keys.job(job_id), "status") == "queued"
    assert owner.get(f"/v1/jobs/{job_id}").json()["status"] == "queued"
    # The owner's SSE stream works, so the 404 above is not just a broken route.
    with owner.stream("GET", f"/v1/jobs/{job_id}/events") as events:
        assert events.status_code == 200
        assert events.headers["content-type"].startswith("text/event-stream")
        first = next(events.iter_lines())
        assert first.startswith("id: "), first
    # And the owner can cancel it.
    assert owner.delete(f"/v1/jobs/{job_id}").json()["status"] == "cancelled"


def test_idempotency_keys_are_per_tenant(two_tenants: tuple[str, httpx.Client, httpx.Client, str]) -> None:
    """Reusing another tenant's Idempotency-Key neither replays its job nor reveals it (no 409)."""
    model, owner, other, _ = two_tenants
    body = {"input": {"text": "same body"}}
    first = owner.post(f"/v1/models/{model}/jobs", json=body, headers={"Idempotency-Key": "shared-key"})
    assert first.status_code == 202, first.text
    same = other.post(f"/v1/models/{model}/jobs", json=body, headers={"Idempotency-Key": "shared-key"})
    assert same.status_code == 202, same.text
    assert same.json()["id"] != first.json()["id"]
    assert "Idempotent-Replayed" not in same.headers
    changed = other.post(f"/v1/models/{model}/jobs", json={"input": {"text": "other body"}},
                         headers={"Idempotency-Key": "shared-key"})
    assert changed.status_code == 409, changed.text  # B's own key, now used with another body
    assert changed.json()["error"]["code"] == "conflict"
    fresh = other.post(f"/v1/models/{model}/jobs", json={"input": {"text": "other body"}},
                       headers={"Idempotency-Key": "owner-only-key"})
    assert fresh.status_code == 202, fresh.text


def test_job_ids_are_unguessable(
    new_tenant: Callable[..., tuple[str, httpx.Client]], register_synthetic: Callable[..., str],
) -> None:
    model = register_synthetic("ids")
    _, client = new_tenant("ids")
    ids: list[str] = []
    for batch in range(2):
        response = client.post(f"/v1/models/{model}/jobs:bulk",
                               json={"inputs": [{"text": f"id {batch} {i}"} for i in range(500)]})
        assert response.status_code == 202, response.text
        ids += response.json()["ids"]
    generated = [new_job_id(model, "v1") for _ in range(1000)]
    for sample in (ids, generated):
        assert len(sample) == 1000
        bad = [i for i in sample if not ID_PATTERN.match(i)]
        assert not bad, bad[:5]
        assert len(set(sample)) == len(sample)
        # No structure to guess from: over 1000 ids, every character of the random part but the
        # last takes (nearly) all 64 values, and together they carry at least 120 bits
        # (token_urlsafe(16) gives 21 x 6 + 2 = 128: the last character holds the remaining 2 bits).
        assert len({i[:9] for i in sample}) == 1  # one version: one slot code
        body = [i[9:] for i in sample]
        seen = [len({b[position] for b in body}) for position in range(min(map(len, body)))]
        assert min(seen[:-1]) >= 56, seen
        assert sum(math.log2(n) for n in seen) >= 120, seen
    assert not set(ids) & set(generated)
