"""Recovery outcomes: the recovery sweep notes, per run it sends on, where the run stood, to tell its agent once.

``runs.recovery`` is set when the sweep sends a step for a run that stopped moving (``{"seq", "failures"}`` as
they were then) and cleared by the sweep pass that reports how that run came out (``on_recovered``/``on_error``
on the agent). Only adds a nullable column and a partial index on it: workers of the previous release keep
running beside this one (they neither set nor read it).

Revision ID: 0016
Revises: 0012
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0016"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Apply this revision."""
    op.add_column("runs", sa.Column("recovery", JSONB, nullable=True))
    op.create_index("runs_recovery_idx", "runs", ["session_id"], postgresql_where=sa.text("recovery IS NOT NULL"))


def downgrade() -> None:
    """Revert this revision (the sweep then reports nothing)."""
    op.drop_index("runs_recovery_idx", table_name="runs")
    op.drop_column("runs", "recovery")
