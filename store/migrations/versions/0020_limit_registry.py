"""The model limit each live worker holds an agent's calls to, so a conflict between releases can be shown.

``agent_workers.model_limit``: the key and numbers (``ModelLimit``) a worker's registration of an agent holds,
None without a limit. Only adds a nullable column: workers of the previous release keep registering without it.

Revision ID: 0020
Revises: 0019
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Apply this revision."""
    op.add_column("agent_workers", sa.Column("model_limit", JSONB, nullable=True))


def downgrade() -> None:
    """Revert this revision (conflicting limits are then only seen in the workers' logs)."""
    op.drop_column("agent_workers", "model_limit")
