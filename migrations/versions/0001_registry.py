"""The registry: tenants, keys, models, versions, routing, pins, audit log, quality aggregates.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_now = sa.text("now()")


def _ts(name: str, *, nullable: bool = False, default: bool = True) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable,
                     server_default=_now if default else None)


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("webhook_secret", sa.String(128), nullable=False),
        sa.Column("rate_limit_per_s", sa.Float, nullable=False, server_default="200"),
        sa.Column("rate_burst", sa.Integer, nullable=False, server_default="2000"),
        sa.Column("max_queued", sa.Integer, nullable=False, server_default="100000"),
        _ts("created_at"),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("tenant_id", sa.String(64), sa.ForeignKey("tenants.id", ondelete="CASCADE"),
                  nullable=False, index=True),
        sa.Column("key_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("is_admin", sa.Boolean, nullable=False, server_default=sa.false()),
        _ts("created_at"),
        _ts("revoked_at", nullable=True, default=False),
    )
    op.create_table(
        "models",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("kind", sa.String(32), nullable=False),
        _ts("created_at"),
        sa.CheckConstraint("kind IN ('embedding', 'classifier', 'synthetic')", name="model_kind"),
    )
    op.create_table(
        "model_versions",
        sa.Column("model", sa.String(64), sa.ForeignKey("models.name", ondelete="CASCADE"), primary_key=True),
        sa.Column("version", sa.String(64), primary_key=True),
        sa.Column("artifact", sa.Text, nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("state", sa.String(16), nullable=False, server_default="staged"),
        sa.Column("max_batch_size", sa.Integer, nullable=False, server_default="32"),
        sa.Column("max_wait_ms", sa.Float, nullable=False, server_default="10"),
        sa.Column("isolate_tenants", sa.Boolean, nullable=False, server_default=sa.true()),
        sa.Column("min_replicas", sa.Integer, nullable=False, server_default="1"),
        sa.Column("max_replicas", sa.Integer, nullable=False, server_default="4"),
        sa.Column("latency_budget_ms", sa.Float, nullable=False, server_default="2000"),
        sa.Column("last_error", sa.Text, nullable=True),
        _ts("created_at"),
        _ts("updated_at"),
        sa.CheckConstraint("state IN ('staged', 'shadow', 'canary', 'stable', 'retired')",
                           name="version_state"),
        sa.CheckConstraint("max_batch_size >= 1", name="batch_size_positive"),
        sa.CheckConstraint("max_wait_ms >= 0", name="wait_non_negative"),
        sa.CheckConstraint("min_replicas >= 0 AND max_replicas >= min_replicas", name="replica_range"),
    )
    version_fk = sa.ForeignKeyConstraint(
        ["model", "version"], ["model_versions.model", "model_versions.version"], ondelete="CASCADE"
    )
    op.create_table(
        "routing_weights",
        sa.Column("model", sa.String(64), primary_key=True),
        sa.Column("version", sa.String(64), primary_key=True),
        sa.Column("weight", sa.Float, nullable=False),
        version_fk,
        sa.CheckConstraint("weight >= 0", name="weight_non_negative"),
    )
    op.create_table(
        "pins",
        sa.Column("tenant_id", sa.String(64), sa.ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("model", sa.String(64), primary_key=True),
        sa.Column("version", sa.String(64), nullable=False),
        _ts("created_at"),
        sa.ForeignKeyConstraint(["model", "version"], ["model_versions.model", "model_versions.version"],
                                ondelete="CASCADE"),
    )
    op.create_table(
        "audit_log",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
        _ts("at"),
        sa.Column("actor", sa.String(128), nullable=False),
        sa.Column("action", sa.String(64), nullable=False),
        sa.Column("model", sa.String(64), nullable=True),
        sa.Column("before", postgresql.JSONB, nullable=True),
        sa.Column("after", postgresql.JSONB, nullable=True),
        sa.Column("reason", sa.Text, nullable=True),
    )
    op.create_index("ix_audit_log_at", "audit_log", ["at"])
    op.create_index("ix_audit_log_model", "audit_log", ["model"])
    op.create_table(
        "quality_aggregates",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
        sa.Column("model", sa.String(64), nullable=False),
        sa.Column("version", sa.String(64), nullable=False),
        sa.Column("window_start", sa.DateTime(timezone=True), nullable=False),
        sa.Column("window_s", sa.Integer, nullable=False),
        sa.Column("count", sa.Integer, nullable=False, server_default="0"),
        sa.Column("errors", sa.Integer, nullable=False, server_default="0"),
        sa.Column("metrics", postgresql.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
        sa.ForeignKeyConstraint(["model", "version"], ["model_versions.model", "model_versions.version"],
                                ondelete="CASCADE"),
        sa.UniqueConstraint("model", "version", "window_start", "window_s", name="quality_window"),
    )


def downgrade() -> None:
    for table in ("quality_aggregates", "audit_log", "pins", "routing_weights", "model_versions",
                  "models", "api_keys", "tenants"):
        op.drop_table(table)
