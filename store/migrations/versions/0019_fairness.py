"""Fairness keys of schedules: the runs a schedule starts carry its fairness key.

``schedules.declare(..., fairness_key=...)``: their waits for a model slot go round-robin by it. Only adds a
nullable column: workers of the previous release keep running beside this one (their schedules start runs without
a key).

Revision ID: 0019
Revises: 0017
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Apply this revision."""
    op.add_column("schedules", sa.Column("fairness_key", sa.Text, nullable=True))


def downgrade() -> None:
    """Revert this revision (schedules then start runs without a fairness key)."""
    op.drop_column("schedules", "fairness_key")
