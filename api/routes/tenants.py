"""Tenants, their API keys, their webhook secrets and their version pins (all admin)."""

from __future__ import annotations

from typing import Annotated, Any

from anyio import to_thread
from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from api.deps import AdminKey, StateDep, announce_routing
from api.field_types import Name
from api.response_models import TenantShare, WebhookSecretRotation
from sluice.fair_share import DEFAULT_SHARE
from sluice.registry import audit, routing_table, tenants
from sluice.webhooks import DEFAULT_SECRET_OVERLAP_S, MAX_SECRET_OVERLAP_S
from sluice.wire import events

router = APIRouter(prefix="/v1", tags=["tenants"])


_SHARE = ("The tenant's weight when tenants share a version's workers: with work waiting, each tenant gets "
          "model time in proportion to its share (1 by default); priority orders a tenant's own jobs, not tenants")


class CreateTenant(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: Name
    admin: bool = False
    rate_limit_per_s: float = Field(default=200.0, gt=0, le=1e6)
    max_queued: int = Field(default=100_000, ge=1, le=10**9)
    share: float = Field(default=DEFAULT_SHARE, gt=0, le=1000, description=_SHARE)


class UpdateTenant(BaseModel):
    model_config = ConfigDict(extra="forbid")
    share: float = Field(gt=0, le=1000, description=_SHARE)
    reason: str | None = Field(default=None, max_length=500, description="Why, for the audit log")


class IssueKey(BaseModel):
    model_config = ConfigDict(extra="forbid")
    admin: bool = False


class RotateWebhookSecret(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # Checked by the registry (sluice.webhooks.check_secret), whose refusals never repeat the value.
    secret: str | None = Field(default=None, description=(
        "The new secret; a fresh `whsec_` one when absent. `whsec_<base64>` (a key of 24 to 64 bytes, as Standard "
        "Webhooks libraries take it) or any other 24 to 128 printable characters, whose UTF-8 bytes are the key"))
    overlap_s: int = Field(default=DEFAULT_SECRET_OVERLAP_S, ge=0, le=MAX_SECRET_OVERLAP_S, description=(
        "Seconds the replaced secret keeps signing deliveries beside the new one, so receivers can switch; "
        "0 stops it at once"))
    reason: str | None = Field(default=None, max_length=500, description="Why, for the audit log")


class SetPin(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: Annotated[str, Field(min_length=1, max_length=64)]


def _key_body(key: tenants.IssuedKey, tenant: str, admin: bool) -> dict[str, Any]:
    return {"id": key.key_id, "tenant": tenant, "admin": admin, "secret": key.secret}


@router.post("/tenants", status_code=201)
async def create_tenant(body: CreateTenant, key: AdminKey, state: StateDep) -> dict[str, Any]:
    def write() -> dict[str, Any]:
        with state.registry.session() as session:
            tenant, issued = tenants.create_tenant(
                session, tenant_id=body.id, actor=f"key:{key.key_id}", is_admin=body.admin,
                rate_limit_per_s=body.rate_limit_per_s, max_queued=body.max_queued, share=body.share,
            )
            return {
                "id": tenant.id,
                "share": tenant.share,
                "key": _key_body(issued, tenant.id, body.admin),
                "webhook_secret": tenant.webhook_secret,
            }

    return await to_thread.run_sync(write)


@router.patch("/tenants/{tenant}", response_model=TenantShare)
async def update_tenant(tenant: str, body: UpdateTenant, key: AdminKey, state: StateDep) -> dict[str, Any]:
    """Set a tenant's `share` (audited). Jobs submitted from then on carry it; this replica's key
    cache is cleared at once, other replicas' within their cache's lifetime."""
    def write() -> dict[str, Any]:
        with state.registry.session() as session:
            row = tenants.set_share(session, tenant_id=tenant, share=body.share, actor=f"key:{key.key_id}",
                                    reason=body.reason)
            return {"id": row.id, "share": row.share}

    answer = await to_thread.run_sync(write)
    state.auth.forget()
    return answer


@router.post("/tenants/{tenant}/keys", status_code=201)
async def issue_key(tenant: str, body: IssueKey, key: AdminKey, state: StateDep) -> dict[str, Any]:
    def write() -> dict[str, Any]:
        with state.registry.session() as session:
            issued = tenants.issue_key(session, tenant_id=tenant, actor=f"key:{key.key_id}", is_admin=body.admin)
            return _key_body(issued, tenant, body.admin)

    return await to_thread.run_sync(write)


@router.delete("/keys/{key_id}")
async def revoke_key(key_id: str, key: AdminKey, state: StateDep) -> dict[str, Any]:
    def write() -> str:
        with state.registry.session() as session:
            return tenants.revoke_key(session, key_id=key_id, actor=f"key:{key.key_id}")

    key_hash = await to_thread.run_sync(write)
    state.auth.forget(key_hash)
    await state.broker.publish(events.KeyRevoked(key_hash=key_hash))
    return {"id": key_id, "revoked": True}


@router.post("/tenants/{tenant}/webhook-secret:rotate", response_model=WebhookSecretRotation)
async def rotate_webhook_secret(tenant: str, key: AdminKey, state: StateDep,
                                body: RotateWebhookSecret | None = None) -> dict[str, Any]:
    """Set or rotate a tenant's webhook secret. Deliveries are signed with both the new and the
    replaced secret until `previous_until`. Delivery workers take a rotation up within a minute:
    switch receivers to the new secret after that."""
    given = body or RotateWebhookSecret()

    def write() -> dict[str, Any]:
        with state.registry.session() as session:
            row, entry = tenants.rotate_webhook_secret(
                session, tenant_id=tenant, actor=f"key:{key.key_id}", secret=given.secret,
                overlap_s=given.overlap_s, reason=given.reason,
            )
            until = row.webhook_secret_previous_until
            return {"tenant": row.id, "webhook_secret": row.webhook_secret,
                    "previous_until": until.isoformat() if until else None,
                    "audit": audit.audit_resource(entry) if entry else None}

    return await to_thread.run_sync(write)


@router.put("/tenants/{tenant}/pins/{model}")
async def set_pin(tenant: str, model: str, body: SetPin, key: AdminKey, state: StateDep) -> dict[str, Any]:
    def write() -> dict[str, Any]:
        with state.registry.session() as session:
            entry = routing_table.set_pin(session, tenant_id=tenant, model=model, version=body.version,
                                    actor=f"key:{key.key_id}")
            return {"tenant": tenant, "model": model, "version": body.version,
                    "audit": audit.audit_resource(entry)}

    result = await to_thread.run_sync(write)
    await announce_routing(state, model)
    return result


@router.delete("/tenants/{tenant}/pins/{model}")
async def delete_pin(tenant: str, model: str, key: AdminKey, state: StateDep) -> dict[str, Any]:
    def write() -> dict[str, Any]:
        with state.registry.session() as session:
            entry = routing_table.delete_pin(session, tenant_id=tenant, model=model, actor=f"key:{key.key_id}")
            return {"tenant": tenant, "model": model, "version": None, "audit": audit.audit_resource(entry)}

    result = await to_thread.run_sync(write)
    await announce_routing(state, model)
    return result
