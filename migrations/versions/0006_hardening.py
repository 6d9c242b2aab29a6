"""A version's opt-in to pickled artifacts, and a schedule's last dispatch error.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("model_versions",
                  sa.Column("allow_pickle", sa.Boolean(), nullable=False, server_default=sa.text("false")))
    op.add_column("schedules", sa.Column("last_error", sa.Text(), nullable=True))
    op.add_column("schedules", sa.Column("last_error_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("schedules", "last_error_at")
    op.drop_column("schedules", "last_error")
    op.drop_column("model_versions", "allow_pickle")
