"""Retention: indexes that let the retention sweep find what is due a page at a time.

Adds an index of finished runs of their own (not sub-agent runs, which go with their lead) by last save, and
indexes of webhook deliveries, GitHub body hashes and claimed schedule ticks by age, so each batch of
``store.retention`` reads only the rows it deletes. Only adds indexes: workers of the previous release keep
running beside this one. Each is built in the migration's transaction, which holds writes to its table
while it is built (a few seconds per million rows).

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

# Spelled out here: a migration keeps the predicate of its own time, whatever the code says later.
_FINISHED_LEADS = "status = 'finished' AND parent_id IS NULL"


def upgrade() -> None:
    """Apply this revision."""
    op.create_index("runs_retention_idx", "runs", ["updated_at"], postgresql_where=sa.text(_FINISHED_LEADS))
    op.create_index("deliveries_received_idx", "deliveries", ["received_at"])
    op.create_index("delivery_bodies_received_idx", "delivery_bodies", ["received_at"])
    op.create_index("schedule_fires_claimed_idx", "schedule_fires", ["claimed_at"])


def downgrade() -> None:
    """Revert this revision (retention then reads whole tables)."""
    op.drop_index("schedule_fires_claimed_idx", table_name="schedule_fires")
    op.drop_index("delivery_bodies_received_idx", table_name="delivery_bodies")
    op.drop_index("deliveries_received_idx", table_name="deliveries")
    op.drop_index("runs_retention_idx", table_name="runs")
