"""Setting and rotating a tenant's webhook secret over REST
(`POST /v1/tenants/{tenant}/webhook-secret:rotate`): what it answers, what the registry then holds,
the audit row, the refusals, and that a tenant's key reaches no tenant's secret, its own included.
The deliveries signed with the result are tests/integration/test_delivery.py's and
tests/integration/test_webhooks.py's."""

from __future__ import annotations

import base64
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from sluice.registry import tenants
from sluice.registry.store import Registry
from sluice.registry.tables import AuditEntry
from sluice.webhooks import WebhookSecrets
from tests.support import unique

pytestmark = pytest.mark.slow


def rotate_path(tenant: str) -> str:
    return f"/v1/tenants/{tenant}/webhook-secret:rotate"


def created(admin: httpx.Client, prefix: str) -> tuple[str, str, str]:
    """A new tenant: its id, its first key and its webhook secret."""
    response = admin.post("/v1/tenants", json={"id": unique(prefix)})
    assert response.status_code == 201, response.text
    body = response.json()
    return body["id"], body["key"]["secret"], body["webhook_secret"]


def secrets_of(registry: Registry, tenant: str) -> WebhookSecrets | None:
    with registry.session() as session:
        return tenants.webhook_secrets(session, tenant)


def rotations(registry: Registry, tenant: str) -> list[AuditEntry]:
    with registry.session() as session:
        entries = session.scalars(select(AuditEntry).where(AuditEntry.action == "tenant.webhook_secret.rotate")
                                  .order_by(AuditEntry.id)).all()
        return [entry for entry in entries if (entry.after or {}).get("tenant") == tenant]


def error_of(response: httpx.Response, status: int) -> dict[str, str]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}, body
    return dict(body["error"])


def test_a_new_tenant_gets_a_standard_webhooks_secret(admin: httpx.Client) -> None:
    _, _, secret = created(admin, "whsec")
    assert secret.startswith("whsec_") and len(base64.b64decode(secret.removeprefix("whsec_"))) == 32


def test_a_rotation_answers_the_new_secret_keeps_the_old_one_for_a_day_and_is_audited(
    admin: httpx.Client, registry: Registry,
) -> None:
    tenant, _, old = created(admin, "rotate")
    before = datetime.now(UTC)
    response = admin.post(rotate_path(tenant), json={"reason": "yearly rotation"})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    new = body["webhook_secret"]
    assert body["tenant"] == tenant and new.startswith("whsec_") and new != old
    until = datetime.fromisoformat(body["previous_until"])
    assert before + timedelta(days=1) <= until <= datetime.now(UTC) + timedelta(days=1)
    assert secrets_of(registry, tenant) == WebhookSecrets(current=new, previous=old, previous_until=until.timestamp())

    audit = body["audit"]
    assert audit["action"] == "tenant.webhook_secret.rotate" and audit["actor"].startswith("key:")
    assert audit["reason"] == "yearly rotation" and audit["after"]["overlap_s"] == 86_400
    [entry] = rotations(registry, tenant)
    assert entry.id == audit["id"]
    assert old not in str(audit) and new not in str(audit)  # the log never holds a secret


def test_a_given_secret_without_overlap_replaces_the_old_one_at_once(admin: httpx.Client, registry: Registry) -> None:
    tenant, _, _ = created(admin, "given")
    given = "whsec_" + base64.b64encode(b"g" * 24).decode()
    response = admin.post(rotate_path(tenant), json={"secret": given, "overlap_s": 0})
    assert response.status_code == 200, response.text
    assert response.json()["webhook_secret"] == given and response.json()["previous_until"] is None
    assert secrets_of(registry, tenant) == WebhookSecrets(current=given)

    again = admin.post(rotate_path(tenant), json={"secret": given})
    assert again.status_code == 200, again.text
    assert again.json()["audit"] is None and again.json()["previous_until"] is None
    assert secrets_of(registry, tenant) == WebhookSecrets(current=given)  # not its own previous secret
    assert len(rotations(registry, tenant)) == 1


def test_a_second_rotation_within_the_overlap_drops_the_oldest_secret(admin: httpx.Client, registry: Registry) -> None:
    tenant, _, first = created(admin, "twice")
    second = admin.post(rotate_path(tenant)).json()["webhook_secret"]  # no body at all: every field is optional
    third = admin.post(rotate_path(tenant), json={"overlap_s": 60}).json()["webhook_secret"]
    found = secrets_of(registry, tenant)
    assert found is not None and (found.current, found.previous) == (third, second)
    assert first not in found.active(datetime.now(UTC).timestamp())


@pytest.mark.parametrize("body", [
    {"secret": "too-short"},
    {"secret": "has spaces in it, more than 24 chars"},
    {"secret": "whsec_not*base64*but*long*enough*0123"},
    {"secret": "whsec_" + base64.b64encode(b"k" * 16).decode()},
])
def test_a_secret_out_of_bounds_is_refused_with_422_and_changes_nothing(
    admin: httpx.Client, registry: Registry, body: dict[str, Any],
) -> None:
    tenant, _, secret = created(admin, "refused")
    error = error_of(admin.post(rotate_path(tenant), json=body), 422)
    assert error["code"] == "invalid_input" and body["secret"] not in error["message"]
    assert secrets_of(registry, tenant) == WebhookSecrets(current=secret)
    assert rotations(registry, tenant) == []


@pytest.mark.parametrize("body", [{"overlap_s": -1}, {"overlap_s": 31 * 86_400}, {"secret": None, "extra": 1}])
def test_a_malformed_body_is_refused_with_422(admin: httpx.Client, registry: Registry, body: dict[str, Any]) -> None:
    tenant, _, secret = created(admin, "malformed")
    error_of(admin.post(rotate_path(tenant), json=body), 422)
    assert secrets_of(registry, tenant) == WebhookSecrets(current=secret)


def test_an_unknown_tenant_is_404(admin: httpx.Client) -> None:
    assert error_of(admin.post(rotate_path(unique("nobody")), json={}), 404)["code"] == "not_found"


def test_a_tenant_key_reaches_no_tenants_secret_and_learns_nothing_from_the_refusal(
    admin: httpx.Client, client_for: Callable[[str], httpx.Client], registry: Registry,
) -> None:
    """Its own tenant, another one and one that does not exist all answer the same 403, and none
    changes: a tenant cannot rotate (or learn of) another's secret, nor its own without an admin."""
    mine, key, my_secret = created(admin, "self")
    other, _, their_secret = created(admin, "neighbour")
    client = client_for(key)
    answers = [client.post(rotate_path(tenant), json={"secret": "a-secret-the-caller-would-like-1"})
               for tenant in (mine, other, unique("nobody"))]
    assert [error_of(answer, 403) for answer in answers] == [error_of(answers[0], 403)] * 3
    assert secrets_of(registry, mine) == WebhookSecrets(current=my_secret)
    assert secrets_of(registry, other) == WebhookSecrets(current=their_secret)


def test_the_schema_documents_the_route_and_its_fields(anon: httpx.Client) -> None:
    spec = anon.get("/openapi.json").json()
    route = spec["paths"]["/v1/tenants/{tenant}/webhook-secret:rotate"]["post"]
    assert route["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/WebhookSecretRotation"}
    fields = spec["components"]["schemas"]["RotateWebhookSecret"]["properties"]
    assert {"secret", "overlap_s", "reason"} == set(fields)
    assert all(field.get("description") for field in fields.values())
    assert "required" not in spec["components"]["schemas"]["RotateWebhookSecret"]
