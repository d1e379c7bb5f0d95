"""SQLAlchemy table definitions: the one description of every table, used by Alembic and tests.

Queries live in the store modules; this file only declares shapes and indexes.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    DateTime,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    Table,
    Text,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB

metadata = MetaData()

#: The latest checkpoint of each run: control fields as columns, the rest in ``document``.
runs = Table(
    "runs",
    metadata,
    Column("session_id", Text, primary_key=True),
    Column("agent", Text, nullable=False),
    Column("status", Text, nullable=False, server_default="in-progress"),
    Column("seq", BigInteger, nullable=False, server_default="0"),
    Column("fence", BigInteger, nullable=False, server_default="0"),
    Column("attempts", Integer, nullable=False, server_default="0"),
    Column("last_error", JSONB, nullable=True),
    Column("inbox_head", BigInteger, nullable=False, server_default="0"),
    Column("inbox_cursor", BigInteger, nullable=False, server_default="0"),
    Column("document", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    #: Usage of a model call whose turn was not saved (its worker died); folded in at the next save.
    Column("uncounted_usage", JSONB, nullable=True),
    Index("runs_status_updated_idx", "status", "updated_at"),
)

#: A ring of the newest saves of each run, written in the same statement as each save.
checkpoint_history = Table(
    "checkpoint_history",
    metadata,
    Column("session_id", Text, nullable=False),
    Column("seq", BigInteger, nullable=False),
    Column("fence", BigInteger, nullable=False),
    Column("step", Integer, nullable=False),
    Column("status", Text, nullable=False),
    Column("saved_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("document", JSONB, nullable=False),
    PrimaryKeyConstraint("session_id", "seq"),
    Index("checkpoint_history_saved_idx", "saved_at"),
)

#: Input sent to a run, durable before it is enqueued; ``n`` is per run and follows commit order.
inbox = Table(
    "inbox",
    metadata,
    Column("session_id", Text, nullable=False),
    Column("n", BigInteger, nullable=False),
    Column("messages", JSONB, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    PrimaryKeyConstraint("session_id", "n"),
)

#: Agents the workers know, registered at worker start so producers can refuse unknown names.
agents = Table(
    "agents",
    metadata,
    Column("name", Text, primary_key=True),
    Column("fingerprint", JSONB, nullable=True),
    Column("seen_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

#: One row per gated tool call of a paused run; decided once, or withdrawn when its run is gone.
approvals = Table(
    "approvals",
    metadata,
    Column("approval_id", Text, primary_key=True),
    Column("session_id", Text, nullable=False),
    Column("tool_call_id", Text, nullable=False),
    Column("tool_name", Text, nullable=False),
    Column("args", JSONB, nullable=False),
    Column("agent", Text, nullable=False),
    Column("status", Text, nullable=False, server_default="pending"),
    Column("note", Text, nullable=True),
    Column("fingerprint", JSONB, nullable=True),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("decided_at", DateTime(timezone=True), nullable=True),
    Index("approvals_session_idx", "session_id"),
    Index("approvals_pending_idx", "created_at", postgresql_where=text("status = 'pending'")),
)
