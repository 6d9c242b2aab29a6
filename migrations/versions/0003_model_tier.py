"""A model's availability tier: `latency` (the default) or `batch`.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("models", sa.Column("tier", sa.String(16), nullable=False, server_default="latency"))
    op.create_check_constraint("model_tier", "models", "tier IN ('latency', 'batch')")


def downgrade() -> None:
    op.drop_constraint("model_tier", "models", type_="check")
    op.drop_column("models", "tier")
