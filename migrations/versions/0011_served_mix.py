"""The served mix and dated tuning: `mix_aggregates`, one row per version, lane and UTC day of input
counts per cost bucket (sluice/mix.py); on `model_versions`, the p99 budget its batching is tuned
to, whether the nightly job may apply its proposal, when and on what mix it was last tuned, and the
job's last proposal (scheduler/retune.py).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

_JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.add_column("model_versions", sa.Column("p99_budget_ms", sa.Float(), nullable=True))
    op.add_column("model_versions",
                  sa.Column("auto_tune", sa.Boolean(), nullable=False, server_default=sa.text("false")))
    op.add_column("model_versions", sa.Column("tuned_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("model_versions", sa.Column("tuned_on", _JSON, nullable=True))
    op.add_column("model_versions", sa.Column("tune_proposal", _JSON, nullable=True))
    op.create_check_constraint("p99_budget_positive", "model_versions", "p99_budget_ms > 0")
    op.create_table(
        "mix_aggregates",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
        sa.Column("model", sa.String(64), nullable=False),
        sa.Column("version", sa.String(64), nullable=False),
        sa.Column("lane", sa.String(16), nullable=False),
        sa.Column("day", sa.Date, nullable=False),
        sa.Column("total", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("counts", postgresql.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
        sa.ForeignKeyConstraint(["model", "version"], ["model_versions.model", "model_versions.version"],
                                ondelete="CASCADE"),
        sa.UniqueConstraint("model", "version", "lane", "day", name="mix_day"),
    )


def downgrade() -> None:
    op.drop_table("mix_aggregates")
    op.drop_constraint("p99_budget_positive", "model_versions", type_="check")
    for column in ("tune_proposal", "tuned_on", "tuned_at", "auto_tune", "p99_budget_ms"):
        op.drop_column("model_versions", column)
