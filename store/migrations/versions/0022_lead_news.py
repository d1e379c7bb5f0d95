"""News of children for their leads: the sweep of waiting leads reads only the leads a child changed for.

The sweep looked at every waiting lead silent for a lease TTL, and most of them had nothing new (a child still
running, a child paused on a person): a pass cost more the more leads waited. Now a child's change that can
matter to its lead (it stops moving, it changes while stopped, it is deleted) stamps the lead's row of
``lead_news`` with a number from ``lead_news_ids``, in the transaction of the change, by triggers on ``runs``:
so every writer, this release's or the previous one's, tells the lead. A lead's claim copies the number it finds
(``runs.news_claimed``); its save records it as seen when the lead saves waiting (news after the claim stays
unseen: the step may have read its children before it) and drops the row otherwise (a lead that does not wait
reads its children at its next step). The sweep reads the rows with unseen news through a partial index, so a
pass costs what the news costs, however many leads wait.

Lock order: a trigger takes the lead's ``lead_news`` row after the rows its statement holds, and nothing takes a
``runs`` row after a ``lead_news`` row, so the orders the store keeps (a run, then the runs under it, then
approvals) stay deadlock-free. Numbers come from one sequence, so a row dropped and written again is never behind
a number a claim copied before.

Waiting leads stored before this revision get news (the sweep looks at each once). Workers of the previous release
keep running beside this one: their claims and saves leave ``news_claimed`` and ``seen`` behind, which only makes
the sweep look at more leads.

Revision ID: 0022
Revises: 0021
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None

# Spelled out here: a migration keeps the predicate of its own time, whatever the code says later. A child that
# can still move by itself: it has work and is not parked.
_MOVES = (
    "(((NEW.status = 'in-progress' AND NOT NEW.aborted AND NOT NEW.waiting)"
    " OR ((NEW.status = 'finished' OR NEW.aborted) AND NEW.inbox_head > NEW.inbox_cursor)"
    " OR (NEW.abort_requested IS NOT NULL AND NEW.status <> 'finished') OR NEW.end_due)"
    " AND (NEW.last_error IS NULL OR (NEW.last_error ->> 'retryable')::boolean))"
)
# The columns a lead's sweep reads of a child: when it last saved, and what says whether it moves.
_READ = (
    "updated_at",
    "status",
    "aborted",
    "waiting",
    "last_error",
    "inbox_head",
    "inbox_cursor",
    "abort_requested",
    "end_due",
)
_OLD, _NEW = (", ".join(f"{row}.{column}" for column in _READ) for row in ("OLD", "NEW"))
_CHANGED = f"(({_OLD}) IS DISTINCT FROM ({_NEW}))"

_FUNCTION = """
CREATE FUNCTION lousho_child_news() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'DELETE' THEN
    DELETE FROM lead_news WHERE lead_id = OLD.session_id;
  END IF;
  IF (CASE WHEN TG_OP = 'DELETE' THEN OLD.parent_id ELSE NEW.parent_id END) IS NOT NULL THEN
    INSERT INTO lead_news (lead_id, n)
    SELECT l.session_id, nextval('lead_news_ids') FROM runs l
    WHERE l.session_id = (CASE WHEN TG_OP = 'DELETE' THEN OLD.parent_id ELSE NEW.parent_id END)
    ON CONFLICT (lead_id) DO UPDATE SET n = EXCLUDED.n;
  END IF;
  RETURN NULL;
END
$$
"""


def upgrade() -> None:
    """Apply this revision."""
    op.execute("CREATE SEQUENCE lead_news_ids")
    op.create_table(
        "lead_news",
        sa.Column("lead_id", sa.Text, primary_key=True),
        sa.Column("n", sa.BigInteger, nullable=False),
        sa.Column("seen", sa.BigInteger, nullable=False, server_default="0"),
    )
    op.create_index("lead_news_unseen_idx", "lead_news", ["lead_id"], postgresql_where=sa.text("n > seen"))
    op.add_column("runs", sa.Column("news_claimed", sa.BigInteger, nullable=False, server_default="0"))
    op.execute(_FUNCTION)
    op.execute(
        "CREATE TRIGGER runs_child_news AFTER UPDATE ON runs FOR EACH ROW"
        f" WHEN (NEW.parent_id IS NOT NULL AND NOT {_MOVES} AND {_CHANGED})"
        " EXECUTE FUNCTION lousho_child_news()"
    )
    op.execute("CREATE TRIGGER runs_gone AFTER DELETE ON runs FOR EACH ROW EXECUTE FUNCTION lousho_child_news()")
    op.execute("INSERT INTO lead_news (lead_id, n) SELECT session_id, nextval('lead_news_ids') FROM runs WHERE waiting")


def downgrade() -> None:
    """Revert this revision (the sweep of the previous release reads every waiting lead again)."""
    op.execute("DROP TRIGGER runs_gone ON runs")
    op.execute("DROP TRIGGER runs_child_news ON runs")
    op.execute("DROP FUNCTION lousho_child_news()")
    op.drop_column("runs", "news_claimed")
    op.drop_index("lead_news_unseen_idx", table_name="lead_news")
    op.drop_table("lead_news")
    op.execute("DROP SEQUENCE lead_news_ids")
