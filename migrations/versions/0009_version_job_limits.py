"""A version's defaults for its jobs' limits: `max_queue_s`, how long a job that names no start
deadline may wait to start, and `run_timeout_s`, for a job that names no run limit (api/routes/jobs.py).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("model_versions", sa.Column("max_queue_s", sa.Float(), nullable=True))
    op.add_column("model_versions", sa.Column("run_timeout_s", sa.Float(), nullable=True))
    op.create_check_constraint("max_queue_positive", "model_versions", "max_queue_s > 0")
    op.create_check_constraint("run_timeout_positive", "model_versions", "run_timeout_s > 0")


def downgrade() -> None:
    op.drop_constraint("run_timeout_positive", "model_versions", type_="check")
    op.drop_constraint("max_queue_positive", "model_versions", type_="check")
    op.drop_column("model_versions", "run_timeout_s")
    op.drop_column("model_versions", "max_queue_s")
