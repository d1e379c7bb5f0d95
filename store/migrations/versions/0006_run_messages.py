"""Append-only transcripts (checkpoint format 2), step one of two.

Adds ``run_messages`` (one row per message of a run) and ``runs.transcript_id``. Only adds: workers of the
previous release keep reading and writing format 1 while this release's workers run beside them. This
release reads both formats and writes format 2, which the previous release hands back unread (it never
parks it). Step two, ``lousho storage upgrade``, moves the runs still stored in format 1 once no worker of
the previous release is left.

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Apply this revision."""
    op.execute("CREATE SEQUENCE run_transcript_ids")
    # A volatile default: Postgres fills existing rows one by one (a table rewrite), once.
    op.add_column(
        "runs",
        sa.Column(
            "transcript_id", sa.BigInteger, nullable=False, server_default=sa.text("nextval('run_transcript_ids')")
        ),
    )
    op.create_table(
        "run_messages",
        sa.Column("session_id", sa.Text, nullable=False),
        sa.Column("slot", sa.Integer, nullable=False),
        sa.Column("seq", sa.BigInteger, nullable=False),
        sa.Column("message", JSONB, nullable=False),
        sa.PrimaryKeyConstraint("session_id", "slot"),
    )


def downgrade() -> None:
    """Revert this revision (only before any run was stored in format 2: their messages go with the table)."""
    op.drop_table("run_messages")
    op.drop_column("runs", "transcript_id")
    op.execute("DROP SEQUENCE run_transcript_ids")
