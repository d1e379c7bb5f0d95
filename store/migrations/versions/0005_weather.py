"""Production weather.

Retry timing on runs, per-worker agent registrations, idempotent sends, broken schedules, and GitHub bodies
seen per agent.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Apply this revision."""
    op.add_column("runs", sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("runs", sa.Column("retry_since", sa.DateTime(timezone=True), nullable=True))
    op.add_column("runs", sa.Column("failures", sa.Integer, nullable=False, server_default="0"))
    op.add_column("runs", sa.Column("swept_at", sa.DateTime(timezone=True), nullable=True))
    # The recovery sweep's listing: only runs that have work, in the order it sends them.
    op.execute(
        "CREATE INDEX runs_movable_idx ON runs ((COALESCE(next_attempt_at, updated_at)), session_id)"
        " WHERE (status = 'in-progress' OR (status = 'finished' AND inbox_head > inbox_cursor))"
    )
    op.create_table(
        "agent_workers",
        sa.Column("agent", sa.Text, nullable=False),
        sa.Column("worker_id", sa.Text, nullable=False),
        sa.Column("fingerprint", JSONB, nullable=True),
        sa.Column("formats", JSONB, nullable=False, server_default=sa.text("'[]'::jsonb")),
        sa.Column("seen_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.PrimaryKeyConstraint("agent", "worker_id"),
    )
    op.create_index("agent_workers_seen_idx", "agent_workers", ["seen_at"])
    op.create_table(
        "sends",
        sa.Column("session_id", sa.Text, nullable=False),
        sa.Column("idempotency_key", sa.Text, nullable=False),
        sa.Column("n", sa.BigInteger, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.PrimaryKeyConstraint("session_id", "idempotency_key"),
    )
    op.add_column("schedules", sa.Column("broken_error", sa.Text, nullable=True))
    op.add_column("schedules", sa.Column("broken_at", sa.DateTime(timezone=True), nullable=True))
    # Broken schedules are skipped by the sweep: keep them out of its index too.
    op.drop_index("schedules_due_idx", table_name="schedules")
    op.create_index(
        "schedules_due_idx",
        "schedules",
        ["next_fire_at"],
        postgresql_where=sa.text("NOT paused AND broken_error IS NULL"),
    )
    op.create_table(
        "delivery_bodies",
        sa.Column("agent", sa.Text, nullable=False),
        sa.Column("body_sha256", sa.Text, nullable=False),
        sa.Column("delivery_id", sa.Text, nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.PrimaryKeyConstraint("agent", "body_sha256"),
    )
    # Bodies of GitHub deliveries already accepted: a replay of one under a new delivery id starts nothing.
    op.execute("""
        INSERT INTO delivery_bodies (agent, body_sha256, delivery_id, received_at)
        SELECT DISTINCT ON (agent, body_sha256) agent, body_sha256, delivery_id, received_at
        FROM deliveries WHERE source = 'github' ORDER BY agent, body_sha256, received_at
        ON CONFLICT DO NOTHING""")


def downgrade() -> None:
    """Revert this revision."""
    op.drop_table("delivery_bodies")
    op.drop_index("schedules_due_idx", table_name="schedules")
    op.create_index("schedules_due_idx", "schedules", ["next_fire_at"], postgresql_where=sa.text("NOT paused"))
    op.drop_column("schedules", "broken_at")
    op.drop_column("schedules", "broken_error")
    op.drop_table("sends")
    op.drop_index("agent_workers_seen_idx", table_name="agent_workers")
    op.drop_table("agent_workers")
    op.drop_index("runs_movable_idx", table_name="runs")
    op.drop_column("runs", "swept_at")
    op.drop_column("runs", "failures")
    op.drop_column("runs", "retry_since")
    op.drop_column("runs", "next_attempt_at")
