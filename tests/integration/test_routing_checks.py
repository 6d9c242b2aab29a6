"""The routing checks of the submit path, over the real API: which versions a caller may name, and
who spends a half-open circuit breaker's probe slot (ARCHITECTURE, "Circuit breaker")."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import redis

from sluice.settings import Settings
from tests.support import ApiServer, http_client, lane_jobs, record_failures, serving, unique, wait_until

# --- shadow and staged versions serve only admins ----------------------------------------------------


@pytest.fixture(scope="module")
def staged_and_shadow(admin: httpx.Client, register_synthetic: Callable[..., str]) -> str:
    """v1 stable with all the traffic, v2 staged, v3 shadow (copies 0 % of v1's jobs)."""
    model = register_synthetic("servable", versions=("v1", "v2", "v3"), weights={"v1": 100.0})
    for version, state in (("v2", "staged"), ("v3", "shadow")):
        response = admin.patch(f"/v1/models/{model}/versions/{version}", json={"state": state, "reason": "test"})
        assert response.status_code == 200, response.text
    return model


@pytest.mark.parametrize("version", ["v2", "v3"], ids=["staged", "shadow"])
def test_a_tenant_naming_a_staged_or_shadow_version_gets_403_not_servable(
    demo: httpx.Client,
    rds: redis.Redis,
    staged_and_shadow: str,
    version: str,
) -> None:
    model = staged_and_shadow
    response = demo.post(f"/v1/models/{model}/jobs", json={"input": {"text": "hi"}, "version": version})
    assert response.status_code == 403, response.text
    assert response.json()["error"]["code"] == "not_servable"
    assert f"'{version}'" in response.json()["error"]["message"]
    assert lane_jobs(rds, model, version, "online") == 0


def test_a_tenant_pinned_to_a_staged_version_gets_403_not_servable(
    admin: httpx.Client,
    new_tenant: Callable[..., tuple[str, httpx.Client]],
    staged_and_shadow: str,
) -> None:
    model = staged_and_shadow
    tenant, client = new_tenant("pinned")
    response = admin.put(f"/v1/tenants/{tenant}/pins/{model}", json={"version": "v2"})
    assert response.status_code == 200, response.text
    refused = client.post(f"/v1/models/{model}/jobs", json={"input": {"text": "hi"}})
    assert refused.status_code == 403, refused.text
    assert refused.json()["error"]["code"] == "not_servable"


@pytest.mark.parametrize("version", ["v2", "v3"], ids=["staged", "shadow"])
def test_an_admin_may_call_a_staged_or_shadow_version(
    admin: httpx.Client,
    staged_and_shadow: str,
    version: str,
) -> None:
    response = admin.post(f"/v1/models/{staged_and_shadow}/jobs", json={"input": {"text": "smoke"}, "version": version})
    assert response.status_code == 202, response.text
    assert response.json()["version"] == version


# --- the half-open probe slot -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def probing_api(settings: Settings) -> Iterator[ApiServer]:
    """A replica whose breakers open on 5 failures in 5 finished jobs and turn half-open after 1 s."""
    tuned = settings.model_copy(update={"breaker_min_samples": 5, "breaker_open_s": 1.0})
    with serving(tuned) as server:
        yield server


def _half_open(api: ApiServer, rds: redis.Redis, model: str, version: str) -> None:
    """Fail five of `version`'s jobs (as its workers record them) and wait for its breaker to go
    open, then half-open."""
    record_failures(rds, model, version, 5)

    def state() -> str:
        return str(api.readyz().get("breakers", {}).get(f"{model}/{version}", {}).get("state"))

    wait_until(lambda: state() == "open", timeout_s=10, what="the breaker to open")
    wait_until(lambda: state() == "half_open", timeout_s=10, what="the breaker to turn half-open")


def test_only_a_job_routed_to_a_half_open_version_spends_its_probe_slot(
    probing_api: ApiServer,
    seeded: Any,
    rds: redis.Redis,
    register_synthetic: Callable[..., str],
) -> None:
    model = register_synthetic("probe", versions=("v1", "v2"), weights={"v1": 100.0})
    _half_open(probing_api, rds, model, "v2")
    submit = f"/v1/models/{model}/jobs"
    with http_client(probing_api.url, seeded.demo_key) as client:
        # Jobs of the model that go to v1 leave v2's probe slot alone ...
        for i in range(3):
            other = client.post(submit, json={"input": {"text": f"to v1 {i}"}})
            assert other.status_code == 202 and other.json()["version"] == "v1", other.text
        # ... so the first job routed to v2 is its probe, and the slot is then spent.
        probe = client.post(submit, json={"input": {"text": "probe"}, "version": "v2"})
        second = client.post(submit, json={"input": {"text": "too soon"}, "version": "v2"})
    assert probe.status_code == 202 and probe.json()["version"] == "v2", probe.text
    assert second.status_code == 503, second.text


def test_a_probe_job_refused_by_admission_gives_the_slot_back(
    probing_api: ApiServer,
    seeded: Any,
    admin: httpx.Client,
    rds: redis.Redis,
    register_synthetic: Callable[..., str],
) -> None:
    model = register_synthetic("probe-refused", versions=("v1", "v2"), weights={"v1": 100.0})
    full = admin.post("/v1/tenants", json={"id": unique("full"), "max_queued": 1}).json()["key"]["secret"]
    submit = f"/v1/models/{model}/jobs"
    with http_client(probing_api.url, full) as client:
        assert client.post(submit, json={"input": {"text": "fills the quota"}}).status_code == 202
        _half_open(probing_api, rds, model, "v2")
        refused = client.post(submit, json={"input": {"text": "probe"}, "version": "v2"})
    with http_client(probing_api.url, seeded.demo_key) as client:
        probe = client.post(submit, json={"input": {"text": "probe"}, "version": "v2"})
    assert refused.status_code == 429 and "quota" in refused.text, refused.text
    assert probe.status_code == 202 and probe.json()["version"] == "v2", probe.text
