"""Drop ``runs_movable_idx``: no query of this release or the previous one reads it, and every save wrote to it.

Revision 0021 gave the recovery sweep two indexes of its own (``runs_stale_idx`` and ``runs_retry_idx``) and kept
``runs_movable_idx`` for the sweep of the release before it. Workers of that release no longer run beside this
one (each release runs beside the one before it only), so the index only costs: an entry for each save of a run
that has work, and its size on disk. Dropping it takes a brief lock on ``runs``.

Revision ID: 0023
Revises: 0022
"""

from __future__ import annotations

from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None

# Spelled out here: a migration keeps the predicate of its own time, whatever the code says later.
_MOVABLE = (
    "((status = 'in-progress' AND NOT aborted AND NOT waiting)"
    " OR ((status = 'finished' OR aborted) AND inbox_head > inbox_cursor)"
    " OR (abort_requested IS NOT NULL AND status <> 'finished')"
    " OR end_due)"
)


def upgrade() -> None:
    """Apply this revision."""
    op.drop_index("runs_movable_idx", table_name="runs")


def downgrade() -> None:
    """Revert this revision (the index is built again, holding writes to ``runs`` while it is built)."""
    op.execute(
        f"CREATE INDEX runs_movable_idx ON runs ((COALESCE(next_attempt_at, updated_at)), session_id) WHERE {_MOVABLE}"
    )
