"""A team's own models: the kinds that serve them, a version's handler class and declared schemas.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

_JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
_KINDS_BEFORE = ("embedding", "classifier", "synthetic")
_KINDS = (*_KINDS_BEFORE, "hf-embedding", "hf-classifier", "torch-export", "handler")


def _kinds(values: tuple[str, ...]) -> str:
    return f"kind IN ({', '.join(repr(v) for v in values)})"


def upgrade() -> None:
    op.drop_constraint("model_kind", "models", type_="check")
    op.create_check_constraint("model_kind", "models", _kinds(_KINDS))
    op.add_column("model_versions", sa.Column("handler", sa.String(200), nullable=True))
    op.add_column("model_versions", sa.Column("input_schema", _JSON, nullable=True))
    op.add_column("model_versions", sa.Column("output_schema", _JSON, nullable=True))
    _rehash_directories()


def _rehash_directories() -> None:
    """A directory artifact's sha256 was that of its model.safetensors alone; it is now that of a
    manifest of every file. Versions whose directory is here and whose weights still match get
    the manifest's hash, so their workers go on loading them, verifying every file from now on;
    any other keeps its hash and is refused until re-registered."""
    from sluice.artifacts import (
        DIR_WEIGHTS_FILE,
        artifact_sha256,
        file_sha256,
        is_remote,
        is_synthetic,
        resolve_artifact,
    )
    from sluice.errors import ArtifactError

    bind = op.get_bind()
    rows = bind.execute(sa.text("SELECT model, version, artifact, sha256 FROM model_versions")).all()
    for model, version, artifact, sha256 in rows:
        if is_synthetic(artifact) or is_remote(artifact):
            continue
        try:
            path = resolve_artifact(artifact)
            if not (path.is_dir() and file_sha256(path / DIR_WEIGHTS_FILE) == sha256):
                continue
            manifest = artifact_sha256(path)
        except ArtifactError:
            continue
        bind.execute(sa.text("UPDATE model_versions SET sha256 = :sha256 WHERE model = :model AND version = :version"),
                     {"sha256": manifest, "model": model, "version": version})


def downgrade() -> None:
    op.drop_column("model_versions", "output_schema")
    op.drop_column("model_versions", "input_schema")
    op.drop_column("model_versions", "handler")
    op.drop_constraint("model_kind", "models", type_="check")
    op.create_check_constraint("model_kind", "models", _kinds(_KINDS_BEFORE))
