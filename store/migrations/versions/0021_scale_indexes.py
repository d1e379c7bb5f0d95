"""Scale of stored runs: indexes that keep the recovery sweep and the retention pass bounded by their work.

The sweep read ``runs_movable_idx`` from its oldest entry and dropped, at every pass, each parked run, each run
saved within a lease TTL and each retry still ahead: a pass cost more the more runs were stored. Two partial
indexes of the runs a step can move, parked ones left out, split by whether they wait for a retry time, let it
read two ranges that hold only the runs due: by last save for those that do not wait (``runs_stale_idx``), by
retry time for those that do (``runs_retry_idx``). The retention pass looked for sub-agent runs whose lead is
gone among every sub-agent run; an index of sub-agent runs by last save (``runs_child_age_idx``) gives it only
those older than its cutoff. Only adds indexes: ``runs_movable_idx`` stays, for the previous release's sweep
(a later release may drop it), and workers of the previous release keep running beside this one. Each is built in
the migration's transaction, which holds writes to ``runs`` while it is built (a few seconds per million rows).

Revision ID: 0021
Revises: 0020
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None

# Spelled out here: a migration keeps the predicate of its own time, whatever the code says later.
_MOVABLE_NOT_PARKED = (
    "((status = 'in-progress' AND NOT aborted AND NOT waiting)"
    " OR ((status = 'finished' OR aborted) AND inbox_head > inbox_cursor)"
    " OR (abort_requested IS NOT NULL AND status <> 'finished')"
    " OR end_due)"
    " AND (last_error IS NULL OR (last_error ->> 'retryable')::boolean)"
)


def upgrade() -> None:
    """Apply this revision."""
    op.create_index(
        "runs_stale_idx",
        "runs",
        ["updated_at", "session_id"],
        postgresql_where=sa.text(f"{_MOVABLE_NOT_PARKED} AND next_attempt_at IS NULL"),
    )
    op.create_index(
        "runs_retry_idx",
        "runs",
        ["next_attempt_at", "session_id"],
        postgresql_where=sa.text(f"{_MOVABLE_NOT_PARKED} AND next_attempt_at IS NOT NULL"),
    )
    op.create_index("runs_child_age_idx", "runs", ["updated_at"], postgresql_where=sa.text("parent_id IS NOT NULL"))


def downgrade() -> None:
    """Revert this revision (the sweep and the retention pass then read more of the runs at each pass)."""
    op.drop_index("runs_child_age_idx", table_name="runs")
    op.drop_index("runs_retry_idx", table_name="runs")
    op.drop_index("runs_stale_idx", table_name="runs")
