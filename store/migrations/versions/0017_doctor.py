"""Doctor: what the I19 checker saw, so its verdict survives between looks and every process reports one figure.

``doctor_runs`` holds the runs the latest look found with nothing to explain them past the grace, with when a look
first saw each so (a run counts as unexplained only once a later look still sees it so, nothing having changed);
``doctor_looks`` holds the latest look's figures, which ``/metrics`` reads as ``lousho_runs_unexplained``. Only
adds tables: workers of the previous release keep running beside this one.

Revision ID: 0017
Revises: 0016
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Apply this revision."""
    op.create_table(
        "doctor_runs",
        sa.Column("session_id", sa.Text, primary_key=True),
        sa.Column("first_seen", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.Column("since", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "doctor_looks",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("looked_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.Column("unexplained", sa.Integer, nullable=False),
        sa.Column("checked", sa.Integer, nullable=False),
        sa.Column("complete", sa.Boolean, nullable=False),
    )


def downgrade() -> None:
    """Revert this revision (the checker then keeps no verdict between looks)."""
    op.drop_table("doctor_looks")
    op.drop_table("doctor_runs")
