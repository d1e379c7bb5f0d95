"""Usage of a model call not yet in a saved checkpoint (the worker died before the save).

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Apply this revision."""
    op.add_column("runs", sa.Column("uncounted_usage", JSONB, nullable=True))


def downgrade() -> None:
    """Revert this revision."""
    op.drop_column("runs", "uncounted_usage")
