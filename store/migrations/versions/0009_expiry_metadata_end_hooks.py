"""Approval expiry, metadata sent with input, and run-end hooks owed.

Adds ``approvals.expires_at`` (an approval past it counts as rejected), ``inbox.metadata`` (what a sender
attached for the application's code) and ``runs.end_due`` (the run ended and its ``on_run_end`` hooks have not
all run yet: the sweep moves such a run until they have). The sweep's index of runs with work is rebuilt
with ``end_due`` in its predicate. Only adds, with defaults: workers of the previous release keep running
beside this one (they set no expiry, send no metadata and owe no hooks).

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

# Spelled out here: a migration keeps the predicate of its own time, whatever the code says later.
_MOVABLE = (
    "((status = 'in-progress' AND NOT aborted)"
    " OR ((status = 'finished' OR aborted) AND inbox_head > inbox_cursor)"
    " OR (abort_requested IS NOT NULL AND status <> 'finished')"
    " OR end_due)"
)
_PREVIOUS_MOVABLE = (
    "((status = 'in-progress' AND NOT aborted)"
    " OR ((status = 'finished' OR aborted) AND inbox_head > inbox_cursor)"
    " OR (abort_requested IS NOT NULL AND status <> 'finished'))"
)


def _movable_index(predicate: str) -> None:
    op.drop_index("runs_movable_idx", table_name="runs")
    op.execute(
        f"CREATE INDEX runs_movable_idx ON runs ((COALESCE(next_attempt_at, updated_at)), session_id) WHERE {predicate}"
    )


def upgrade() -> None:
    """Apply this revision."""
    op.add_column("approvals", sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
    op.create_index(
        "approvals_expiry_idx",
        "approvals",
        ["expires_at"],
        postgresql_where=sa.text("status = 'pending' AND expires_at IS NOT NULL"),
    )
    op.add_column("inbox", sa.Column("metadata", JSONB, nullable=True))
    op.add_column("runs", sa.Column("end_due", sa.Boolean, nullable=False, server_default=sa.false()))
    _movable_index(_MOVABLE)


def downgrade() -> None:
    """Revert this revision (expiry times, metadata and owed hooks go with their columns)."""
    _movable_index(_PREVIOUS_MOVABLE)
    op.drop_column("runs", "end_due")
    op.drop_column("inbox", "metadata")
    op.drop_index("approvals_expiry_idx", table_name="approvals")
    op.drop_column("approvals", "expires_at")
