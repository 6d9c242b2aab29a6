"""The routing checks of the submit path, over the real API: which versions a caller may name
(DESIGN §4, §6)."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest
import redis

from sluice import keys

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
    assert rds.xlen(keys.stream(model, version, "online")) == 0


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
