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


def downgrade() -> None:
    op.drop_column("model_versions", "output_schema")
    op.drop_column("model_versions", "input_schema")
    op.drop_column("model_versions", "handler")
    op.drop_constraint("model_kind", "models", type_="check")
    op.create_check_constraint("model_kind", "models", _kinds(_KINDS_BEFORE))
