"""Runs listing: an index of runs by creation, so a page of the runs list reads its rows and no others.

``store.listing`` pages runs newest first by ``(created_at, session_id)`` from a cursor; with this index a page
is one backward index scan of its own rows, whatever the depth, instead of a sort of the whole table. Only adds an
index: workers of the previous release keep running beside this one. It is built in the migration's transaction,
which holds writes to ``runs`` while it is built (a few seconds per million rows).

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Apply this revision."""
    op.create_index("runs_created_idx", "runs", ["created_at", "session_id"])


def downgrade() -> None:
    """Revert this revision (the listing then sorts the runs it reads)."""
    op.drop_index("runs_created_idx", table_name="runs")
