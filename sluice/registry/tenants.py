"""Tenants and their API keys: issued once (only the hash is kept), looked up on every request,
revoked with an audit row; a tenant's webhook secrets and their rotation."""

from __future__ import annotations

import base64
import hashlib
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from sluice.errors import Conflict, NotFound
from sluice.fair_share import DEFAULT_SHARE
from sluice.registry import audit
from sluice.registry.tables import (
    ApiKey,
    AuditEntry,
    Tenant,
)
from sluice.webhooks import SECRET_PREFIX, WebhookSecrets, check_secret

KEY_PREFIX = "sk"


@dataclass(frozen=True, slots=True)
class KeyInfo:
    key_id: str
    tenant: str
    is_admin: bool
    rate_limit_per_s: float = 200.0
    rate_burst: int = 2000
    max_queued: int = 100_000
    share: float = DEFAULT_SHARE


@dataclass(frozen=True, slots=True)
class IssuedKey:
    key_id: str
    secret: str  # shown once, never stored


def new_webhook_secret() -> str:
    """A fresh secret in the Standard Webhooks form: `whsec_` and 32 random bytes in base64, which
    that specification's libraries take as it is."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def hash_key(raw_key: str) -> str:
    # Keys carry 192 random bits, so a fast hash is as safe as a slow one and keeps auth cheap.
    return hashlib.sha256(raw_key.encode()).hexdigest()


def _new_key(session: Session, tenant_id: str, *, is_admin: bool, raw: str | None = None) -> IssuedKey:
    key_id = secrets.token_hex(6)
    secret = raw or f"{KEY_PREFIX}_{key_id}_{secrets.token_urlsafe(24)}"
    session.add(ApiKey(id=key_id, tenant_id=tenant_id, key_hash=hash_key(secret), is_admin=is_admin))
    return IssuedKey(key_id=key_id, secret=secret)


def create_tenant(
    session: Session,
    *,
    tenant_id: str,
    actor: str,
    is_admin: bool = False,
    rate_limit_per_s: float = 200.0,
    max_queued: int = 100_000,
    share: float = DEFAULT_SHARE,
) -> tuple[Tenant, IssuedKey]:
    if session.get(Tenant, tenant_id) is not None:
        raise Conflict(f"tenant '{tenant_id}' already exists")
    tenant = Tenant(
        id=tenant_id,
        webhook_secret=new_webhook_secret(),
        rate_limit_per_s=rate_limit_per_s,
        rate_burst=max(1, int(rate_limit_per_s * 10)),
        max_queued=max_queued,
        share=share,
    )
    session.add(tenant)
    session.flush()
    key = _new_key(session, tenant_id, is_admin=is_admin)
    audit.record(session, actor=actor, action="tenant.create", model=None, before=None,
           after={"tenant": tenant_id, "key_id": key.key_id, "admin": is_admin}, reason=None)
    return tenant, key


def ensure_tenant_key(session: Session, *, tenant_id: str, raw_key: str, is_admin: bool) -> None:
    """Idempotent seeding: make `raw_key` a valid key of `tenant_id` (created if missing)."""
    if session.get(Tenant, tenant_id) is None:
        session.add(Tenant(id=tenant_id, webhook_secret=new_webhook_secret()))
        session.flush()
    existing = session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(raw_key)))
    if existing is None:
        _new_key(session, tenant_id, is_admin=is_admin, raw=raw_key)
    elif existing.revoked_at is not None or existing.is_admin != is_admin:
        existing.revoked_at = None
        existing.is_admin = is_admin


def issue_key(session: Session, *, tenant_id: str, actor: str, is_admin: bool = False) -> IssuedKey:
    if session.get(Tenant, tenant_id) is None:
        raise NotFound(f"tenant '{tenant_id}' does not exist")
    key = _new_key(session, tenant_id, is_admin=is_admin)
    audit.record(session, actor=actor, action="key.issue", model=None, before=None,
           after={"tenant": tenant_id, "key_id": key.key_id, "admin": is_admin}, reason=None)
    return key


def revoke_key(session: Session, *, key_id: str, actor: str) -> str:
    key = session.get(ApiKey, key_id)
    if key is None or key.revoked_at is not None:
        raise NotFound(f"key '{key_id}' does not exist")
    key.revoked_at = datetime.now(UTC)
    audit.record(session, actor=actor, action="key.revoke", model=None,
           before={"key_id": key_id}, after=None, reason=None)
    return key.key_hash


def lookup_key(session: Session, raw_key: str) -> KeyInfo | None:
    found = session.execute(
        select(ApiKey, Tenant)
        .join(Tenant, Tenant.id == ApiKey.tenant_id)
        .where(ApiKey.key_hash == hash_key(raw_key), ApiKey.revoked_at.is_(None))
    ).first()
    if found is None:
        return None
    key, tenant = found
    return KeyInfo(key_id=key.id, tenant=key.tenant_id, is_admin=key.is_admin,
                   rate_limit_per_s=tenant.rate_limit_per_s, rate_burst=tenant.rate_burst,
                   max_queued=tenant.max_queued, share=tenant.share)


def tenant_secret(session: Session, tenant_id: str) -> str | None:
    """The tenant's current webhook secret."""
    tenant = session.get(Tenant, tenant_id)
    return tenant.webhook_secret if tenant else None


def webhook_secrets(session: Session, tenant_id: str) -> WebhookSecrets | None:
    """The tenant's current secret and, during a rotation, the previous one and its end."""
    tenant = session.get(Tenant, tenant_id)
    if tenant is None:
        return None
    until = tenant.webhook_secret_previous_until
    return WebhookSecrets(current=tenant.webhook_secret, previous=tenant.webhook_secret_previous,
                          previous_until=until.timestamp() if until is not None else None)


def set_share(session: Session, *, tenant_id: str, share: float, actor: str, reason: str | None = None) -> Tenant:
    """Change the tenant's weight in fair sharing; its keys' cached lookups carry the old one until
    they expire (`api/deps.py`), and its jobs already queued keep theirs."""
    tenant = session.get(Tenant, tenant_id, with_for_update=True)
    if tenant is None:
        raise NotFound(f"tenant '{tenant_id}' does not exist")
    if tenant.share != share:
        audit.record(session, actor=actor, action="tenant.share", model=None,
                     before={"tenant": tenant_id, "share": tenant.share}, after={"tenant": tenant_id, "share": share},
                     reason=reason)
        tenant.share = share
    return tenant


def rotate_webhook_secret(session: Session, *, tenant_id: str, actor: str, secret: str | None = None,
                          overlap_s: int, reason: str | None = None,
                          now: datetime | None = None) -> tuple[Tenant, AuditEntry | None]:
    """Make `secret` (a fresh one when None) the tenant's webhook secret. The one it replaces keeps
    signing for `overlap_s` seconds (0: stops at once); one left by an earlier rotation stops now,
    so at most two sign a delivery. Setting the current secret again changes nothing (no audit
    row): it must not become its own previous one."""
    tenant = session.get(Tenant, tenant_id, with_for_update=True)
    if tenant is None:
        raise NotFound(f"tenant '{tenant_id}' does not exist")
    new = new_webhook_secret() if secret is None else check_secret(secret)
    if new == tenant.webhook_secret:
        return tenant, None
    before = tenant.webhook_secret_previous_until
    until = (now or datetime.now(UTC)) + timedelta(seconds=overlap_s) if overlap_s > 0 else None
    tenant.webhook_secret_previous = tenant.webhook_secret if until is not None else None
    tenant.webhook_secret_previous_until = until
    tenant.webhook_secret = new
    # The audit row says what changed and until when the old secret signs, never a secret.
    entry = audit.record(
        session, actor=actor, action="tenant.webhook_secret.rotate", model=None,
        before={"tenant": tenant_id, "previous_until": before.isoformat() if before else None},
        after={"tenant": tenant_id, "given": secret is not None, "overlap_s": overlap_s,
               "previous_until": until.isoformat() if until else None},
        reason=reason,
    )
    return tenant, entry
