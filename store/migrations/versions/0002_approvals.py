"""Approvals: one row per gated tool call of a paused run.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Apply this revision."""
    op.create_table(
        "approvals",
        sa.Column("approval_id", sa.Text, primary_key=True),
        sa.Column("session_id", sa.Text, nullable=False),
        sa.Column("tool_call_id", sa.Text, nullable=False),
        sa.Column("tool_name", sa.Text, nullable=False),
        sa.Column("args", JSONB, nullable=False),
        sa.Column("agent", sa.Text, nullable=False),
        sa.Column("status", sa.Text, nullable=False, server_default="pending"),
        sa.Column("note", sa.Text, nullable=True),
        sa.Column("fingerprint", JSONB, nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.Column("decided_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("approvals_session_idx", "approvals", ["session_id"])
    op.create_index(
        "approvals_pending_idx", "approvals", ["created_at"], postgresql_where=sa.text("status = 'pending'")
    )


def downgrade() -> None:
    """Revert this revision."""
    op.drop_index("approvals_pending_idx", table_name="approvals")
    op.drop_index("approvals_session_idx", table_name="approvals")
    op.drop_table("approvals")
