"""Webhook deliveries and schedules: the unique keys that make a delivery and a tick start one run.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Apply this revision."""
    op.create_table(
        "deliveries",
        sa.Column("agent", sa.Text, nullable=False),
        sa.Column("delivery_id", sa.Text, nullable=False),
        sa.Column("session_id", sa.Text, nullable=False),
        sa.Column("source", sa.Text, nullable=False),
        sa.Column("body_sha256", sa.Text, nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.PrimaryKeyConstraint("agent", "delivery_id"),
    )
    op.create_index("deliveries_session_idx", "deliveries", ["session_id"])
    op.create_table(
        "schedules",
        sa.Column("schedule_id", sa.BigInteger, sa.Identity(always=True), primary_key=True),
        sa.Column("name", sa.Text, nullable=False, unique=True),
        sa.Column("agent", sa.Text, nullable=False),
        sa.Column("input", JSONB, nullable=False),
        sa.Column("cron", sa.Text, nullable=True),
        sa.Column("every_s", sa.Integer, nullable=True),
        sa.Column("timezone", sa.Text, nullable=False, server_default="UTC"),
        sa.Column("overlap", sa.Text, nullable=False, server_default="skip"),
        sa.Column("catch_up", sa.Text, nullable=False, server_default="one"),
        sa.Column("paused", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("origin", sa.Text, nullable=False, server_default="api"),
        sa.Column("next_fire_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_fire_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_session_id", sa.Text, nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.CheckConstraint("(cron IS NULL) <> (every_s IS NULL)", name="schedules_one_timing"),
    )
    op.create_index("schedules_due_idx", "schedules", ["next_fire_at"], postgresql_where=sa.text("NOT paused"))
    op.create_table(
        "schedule_fires",
        sa.Column(
            "schedule_id", sa.BigInteger, sa.ForeignKey("schedules.schedule_id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("fire_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("session_id", sa.Text, nullable=True),
        sa.Column("outcome", sa.Text, nullable=False),
        sa.Column("claimed_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.PrimaryKeyConstraint("schedule_id", "fire_at"),
    )


def downgrade() -> None:
    """Revert this revision."""
    op.drop_table("schedule_fires")
    op.drop_index("schedules_due_idx", table_name="schedules")
    op.drop_table("schedules")
    op.drop_index("deliveries_session_idx", table_name="deliveries")
    op.drop_table("deliveries")
