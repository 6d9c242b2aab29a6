"""A tenant's previous webhook secret and until when it still signs deliveries, so a secret can be
rotated with both signatures sent meanwhile (sluice/registry/tenants.py: `rotate_webhook_secret`).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tenants", sa.Column("webhook_secret_previous", sa.String(128), nullable=True))
    op.add_column("tenants", sa.Column("webhook_secret_previous_until", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("tenants", "webhook_secret_previous_until")
    op.drop_column("tenants", "webhook_secret_previous")
