"""Batch scoring, cron schedules of batch runs, and the per-version response cache.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
_WHEN = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.add_column("model_versions", sa.Column("cache_ttl_s", sa.Integer(), nullable=False, server_default="0"))
    op.create_check_constraint("cache_ttl_non_negative", "model_versions", "cache_ttl_s >= 0")

    op.create_table(
        "schedules",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("tenant_id", sa.String(64), sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False),
        sa.Column("model", sa.String(64), sa.ForeignKey("models.name", ondelete="CASCADE"), nullable=False),
        sa.Column("version", sa.String(64), nullable=True),
        sa.Column("cron", sa.String(128), nullable=False),
        sa.Column("timezone", sa.String(64), nullable=False),
        sa.Column("input_uri", sa.Text(), nullable=False),
        sa.Column("input_format", sa.String(16), nullable=True),
        sa.Column("text_field", sa.String(128), nullable=False),
        sa.Column("output_uri", sa.Text(), nullable=True),
        sa.Column("output_format", sa.String(16), nullable=False),
        sa.Column("callback_url", sa.Text(), nullable=True),
        sa.Column("actor", sa.String(128), nullable=False),
        sa.Column("created_at", _WHEN, server_default=sa.func.now(), nullable=False),
        sa.Column("next_slot", _WHEN, nullable=False),
    )
    op.create_index("ix_schedules_next_slot", "schedules", ["next_slot"])

    op.create_table(
        "batches",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("tenant_id", sa.String(64), sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False),
        sa.Column("model", sa.String(64), nullable=False),
        sa.Column("version", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False, server_default="queued"),
        sa.Column("total", sa.BigInteger(), nullable=True),
        sa.Column("done", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("failed", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("created_at", _WHEN, server_default=sa.func.now(), nullable=False),
        sa.Column("started_at", _WHEN, nullable=True),
        sa.Column("finished_at", _WHEN, nullable=True),
        sa.Column("input_path", sa.Text(), nullable=False),
        sa.Column("input_format", sa.String(16), nullable=False),
        sa.Column("text_field", sa.String(128), nullable=False),
        sa.Column("output_format", sa.String(16), nullable=False),
        sa.Column("output_path", sa.Text(), nullable=True),
        sa.Column("callback_url", sa.Text(), nullable=True),
        sa.Column("callback_sent", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.Column("metadata", _JSON, nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        # No foreign key: a deleted schedule's runs stay listed under its id.
        sa.Column("schedule_id", sa.String(32), nullable=True),
        sa.Column("slot", _WHEN, nullable=True),
        sa.Column("rows_written", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("bytes_written", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("lease_owner", sa.String(64), nullable=True),
        sa.Column("lease_until", _WHEN, nullable=True),
        sa.Column("dispatched_at", _WHEN, nullable=True),
        sa.CheckConstraint("status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')",
                           name="batch_status"),
        sa.UniqueConstraint("schedule_id", "slot", name="one_run_per_slot"),
    )
    op.create_index("ix_batches_tenant_created", "batches", ["tenant_id", "created_at"])
    op.create_index("ix_batches_status", "batches", ["status"])


def downgrade() -> None:
    op.drop_table("batches")
    op.drop_table("schedules")
    op.drop_constraint("cache_ttl_non_negative", "model_versions", type_="check")
    op.drop_column("model_versions", "cache_ttl_s")
