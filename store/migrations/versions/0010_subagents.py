"""Sub-agents: a child run knows its lead, and a lead waiting on its children has no work of its own.

Adds ``runs.parent_id`` (the lead of a child run, ``<lead>.task-<16 hex>``) and ``runs.waiting`` (the run's
last turn delegated calls to children that have not all settled: no step is due until one of them settles),
an index of children by lead, an index of waiting leads for the sweep, and rebuilds the sweep's index of runs
with work without waiting leads. Only adds, with defaults: workers of the previous release keep running
beside this one (they start no children).

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

# Spelled out here: a migration keeps the predicate of its own time, whatever the code says later.
_MOVABLE = (
    "((status = 'in-progress' AND NOT aborted AND NOT waiting)"
    " OR ((status = 'finished' OR aborted) AND inbox_head > inbox_cursor)"
    " OR (abort_requested IS NOT NULL AND status <> 'finished')"
    " OR end_due)"
)
_PREVIOUS_MOVABLE = (
    "((status = 'in-progress' AND NOT aborted)"
    " OR ((status = 'finished' OR aborted) AND inbox_head > inbox_cursor)"
    " OR (abort_requested IS NOT NULL AND status <> 'finished')"
    " OR end_due)"
)


def _movable_index(predicate: str) -> None:
    op.drop_index("runs_movable_idx", table_name="runs")
    op.execute(
        f"CREATE INDEX runs_movable_idx ON runs ((COALESCE(next_attempt_at, updated_at)), session_id) WHERE {predicate}"
    )


def upgrade() -> None:
    """Apply this revision."""
    op.add_column("runs", sa.Column("parent_id", sa.Text, nullable=True))
    op.add_column("runs", sa.Column("waiting", sa.Boolean, nullable=False, server_default=sa.false()))
    op.create_index("runs_parent_idx", "runs", ["parent_id"], postgresql_where=sa.text("parent_id IS NOT NULL"))
    op.create_index("runs_waiting_idx", "runs", ["updated_at"], postgresql_where=sa.text("waiting"))
    _movable_index(_MOVABLE)


def downgrade() -> None:
    """Revert this revision (the links between leads and children go with their columns)."""
    _movable_index(_PREVIOUS_MOVABLE)
    op.drop_index("runs_waiting_idx", table_name="runs")
    op.drop_index("runs_parent_idx", table_name="runs")
    op.drop_column("runs", "waiting")
    op.drop_column("runs", "parent_id")
