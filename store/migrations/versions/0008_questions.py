"""Questions to a person: an approval of kind ``question`` with its options and the answer given.

Adds four columns to ``approvals`` (``kind`` defaults to ``tool``, the others are empty). Only adds: workers
of the previous release keep opening and reading tool approvals.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Apply this revision."""
    op.add_column("approvals", sa.Column("kind", sa.Text, nullable=False, server_default="tool"))
    op.add_column("approvals", sa.Column("question", sa.Text, nullable=True))
    op.add_column("approvals", sa.Column("options", JSONB, nullable=True))
    op.add_column("approvals", sa.Column("answer", sa.Text, nullable=True))


def downgrade() -> None:
    """Revert this revision (questions and answers go with their columns)."""
    for column in ("answer", "options", "question", "kind"):
        op.drop_column("approvals", column)
