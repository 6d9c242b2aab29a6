"""Rollouts and every decision the rollout controller takes.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "rollouts",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
        sa.Column("model", sa.String(64), sa.ForeignKey("models.name", ondelete="CASCADE"), nullable=False),
        sa.Column("canary", sa.String(64), nullable=False),
        sa.Column("stable", sa.String(64), nullable=False),
        sa.Column("policy", postgresql.JSONB, nullable=False),
        sa.Column("initial_weights", postgresql.JSONB, nullable=False),
        sa.Column("canary_initial_state", sa.String(16), nullable=False),
        sa.Column("step_index", sa.Integer, nullable=False),
        sa.Column("state", sa.String(16), nullable=False, server_default="running"),
        sa.Column("actor", sa.String(128), nullable=False),
        sa.Column("reason", sa.Text, nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("step_started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["model", "canary"], ["model_versions.model", "model_versions.version"],
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["model", "stable"], ["model_versions.model", "model_versions.version"],
                                ondelete="CASCADE"),
        sa.CheckConstraint("state IN ('running', 'promoted', 'rolled_back', 'aborted')", name="rollout_state"),
        sa.CheckConstraint("canary <> stable", name="rollout_two_versions"),
    )
    op.create_index("ix_rollouts_model", "rollouts", ["model"])
    # At most one running rollout per model: two controllers' changes would fight over the weights.
    op.create_index("one_running_rollout", "rollouts", ["model"], unique=True,
                    postgresql_where=sa.text("state = 'running'"))
    op.create_table(
        "rollout_decisions",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
        sa.Column("rollout_id", sa.BigInteger, sa.ForeignKey("rollouts.id", ondelete="CASCADE"), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("step_index", sa.Integer, nullable=False),
        sa.Column("action", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("evidence", postgresql.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
        sa.Column("audit_id", sa.BigInteger, sa.ForeignKey("audit_log.id", ondelete="SET NULL"), nullable=True),
        sa.CheckConstraint("action IN ('start', 'continue', 'promote', 'rollback', 'abort')", name="rollout_action"),
    )
    op.create_index("ix_rollout_decisions_rollout_id", "rollout_decisions", ["rollout_id"])


def downgrade() -> None:
    op.drop_table("rollout_decisions")
    op.drop_table("rollouts")
