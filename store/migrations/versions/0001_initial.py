"""Initial schema: runs, checkpoint_history, inbox, agents.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Apply this revision."""
    op.create_table(
        "runs",
        sa.Column("session_id", sa.Text, primary_key=True),
        sa.Column("agent", sa.Text, nullable=False),
        sa.Column("status", sa.Text, nullable=False, server_default="in-progress"),
        sa.Column("seq", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("fence", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("last_error", JSONB, nullable=True),
        sa.Column("inbox_head", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("inbox_cursor", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("document", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    )
    op.create_index("runs_status_updated_idx", "runs", ["status", "updated_at"])
    op.create_table(
        "checkpoint_history",
        sa.Column("session_id", sa.Text, nullable=False),
        sa.Column("seq", sa.BigInteger, nullable=False),
        sa.Column("fence", sa.BigInteger, nullable=False),
        sa.Column("step", sa.Integer, nullable=False),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("saved_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.Column("document", JSONB, nullable=False),
        sa.PrimaryKeyConstraint("session_id", "seq"),
    )
    op.create_index("checkpoint_history_saved_idx", "checkpoint_history", ["saved_at"])
    op.create_table(
        "inbox",
        sa.Column("session_id", sa.Text, nullable=False),
        sa.Column("n", sa.BigInteger, nullable=False),
        sa.Column("messages", JSONB, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.PrimaryKeyConstraint("session_id", "n"),
    )
    op.create_table(
        "agents",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("fingerprint", JSONB, nullable=True),
        sa.Column("seen_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    )


def downgrade() -> None:
    """Revert this revision."""
    op.drop_table("agents")
    op.drop_table("inbox")
    op.drop_index("checkpoint_history_saved_idx", table_name="checkpoint_history")
    op.drop_table("checkpoint_history")
    op.drop_index("runs_status_updated_idx", table_name="runs")
    op.drop_table("runs")
