"""A tenant's `share`: its weight when tenants share a version's workers (sluice/fair_share.py).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tenants", sa.Column("share", sa.Float(), nullable=False, server_default="1.0"))
    op.create_check_constraint("share_positive", "tenants", "share > 0")


def downgrade() -> None:
    op.drop_constraint("share_positive", "tenants", type_="check")
    op.drop_column("tenants", "share")
