"""Durable run events, and abort requests.

Adds ``run_events`` (a run's numbered events; a row may point at a ``run_messages`` row by slot) and three
columns of ``runs``: ``events_next`` (the next event's seq), ``abort_requested`` (when an abort was asked
for and not yet settled by a step) and ``aborted`` (the run stopped on an abort and waits for a send or a
resume). Only adds, with defaults: workers of the previous release keep running beside this one (they
write no events and do not see abort requests; a step of this release settles them).

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

# Spelled out here: a migration keeps the predicate of its own time, whatever the code says later.
_MOVABLE = (
    "((status = 'in-progress' AND NOT aborted)"
    " OR ((status = 'finished' OR aborted) AND inbox_head > inbox_cursor)"
    " OR (abort_requested IS NOT NULL AND status <> 'finished'))"
)
_PREVIOUS_MOVABLE = "(status = 'in-progress' OR (status = 'finished' AND inbox_head > inbox_cursor))"


def upgrade() -> None:
    """Apply this revision."""
    op.add_column("runs", sa.Column("events_next", sa.BigInteger, nullable=False, server_default="0"))
    op.add_column("runs", sa.Column("abort_requested", sa.DateTime(timezone=True), nullable=True))
    op.add_column("runs", sa.Column("aborted", sa.Boolean, nullable=False, server_default=sa.false()))
    # The sweep's index follows the new has-work rule (aborted runs rest; abort requests are work).
    op.drop_index("runs_movable_idx", table_name="runs")
    op.execute(
        f"CREATE INDEX runs_movable_idx ON runs ((COALESCE(next_attempt_at, updated_at)), session_id) WHERE {_MOVABLE}"
    )
    op.create_table(
        "run_events",
        sa.Column("session_id", sa.Text, nullable=False),
        sa.Column("seq", sa.BigInteger, nullable=False),
        sa.Column("type", sa.Text, nullable=False),
        sa.Column("slot", sa.Integer, nullable=True),
        sa.Column("data", JSONB, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.PrimaryKeyConstraint("session_id", "seq"),
    )


def downgrade() -> None:
    """Revert this revision (the events go with their table)."""
    op.drop_table("run_events")
    op.drop_index("runs_movable_idx", table_name="runs")
    op.execute(
        "CREATE INDEX runs_movable_idx ON runs ((COALESCE(next_attempt_at, updated_at)), session_id)"
        f" WHERE {_PREVIOUS_MOVABLE}"
    )
    op.drop_column("runs", "aborted")
    op.drop_column("runs", "abort_requested")
    op.drop_column("runs", "events_next")
