"""Approval records in Postgres: create with the pausing save, list, decide once, withdraw, expire.

A decision is taken under row locks of the approval and its run, so concurrent resolves of one
approval decide it once, and an approval whose run no longer waits on it is withdrawn. An approval
past its ``expires_at`` (Postgres's clock) counts as rejected: a late decision records it so, and so
does the recovery sweep (``expire_due``).
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine, text
from sqlalchemy.engine import Connection

from store import errors, inputs, payloads
from store.database import Transaction
from store.records import Approval, Decision

__all__ = ["EXPIRED_NOTE", "PostgresApprovalStore", "expire_due", "insert", "put_back", "withdraw_for_run"]

#: How the note of an expired approval starts; the expiry time follows, in ISO 8601 (UTC, microseconds).
EXPIRED_NOTE = "expired: no decision before "
_COLUMNS = (
    "approval_id, session_id, tool_call_id, tool_name, args, agent, status, note, fingerprint,"
    " created_at, decided_at, kind, question, options, answer, expires_at"
)
# make_interval is strict: no expires_in, no expiry.
_INSERT = text("""
INSERT INTO approvals (approval_id, session_id, tool_call_id, tool_name, args, agent, fingerprint, kind, question,
  options, expires_at)
VALUES (:approval_id, :session_id, :tool_call_id, :tool_name, CAST(:args AS jsonb), :agent, CAST(:fingerprint AS jsonb),
  :kind, :question, CAST(:options AS jsonb), now() + make_interval(secs => CAST(:expires_in AS double precision)))
ON CONFLICT (approval_id) DO NOTHING
""")
_NOTE_OF_EXPIRY = (
    "'" + EXPIRED_NOTE + "'"
    """ || to_char(expires_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"')"""
)
_BY_IDS = text(f"SELECT {_COLUMNS} FROM approvals WHERE approval_id = ANY(:ids)")
_SESSION_OF = text("SELECT session_id FROM approvals WHERE approval_id = :id")
_LOCK_APPROVAL = text(f"SELECT {_COLUMNS} FROM approvals WHERE approval_id = :id FOR UPDATE")
_LOCK_RUN = text("SELECT status, document -> 'approval_ids' AS ids FROM runs WHERE session_id = :sid FOR UPDATE")
_DECIDE = text(
    "UPDATE approvals SET status = :status, note = :note, answer = :answer, decided_at = now() WHERE approval_id = :id"
)
# A decision that comes too late: recorded as the expiry's rejection, in the decision's transaction.
_EXPIRE_ONE = text(f"""
UPDATE approvals SET status = 'rejected', note = {_NOTE_OF_EXPIRY}, answer = NULL, decided_at = now()
WHERE approval_id = :id AND status = 'pending' AND expires_at <= now()
RETURNING note
""")
_STILL_PENDING = text("SELECT count(*) FROM approvals WHERE approval_id = ANY(:ids) AND status = 'pending'")
# Leave updated_at alone: the sweep then sees the run as stale at once if the enqueue is lost.
_CONTINUE_RUN = text("UPDATE runs SET status = 'in-progress', last_error = NULL, attempts = 0 WHERE session_id = :sid")
_UNDECIDE = text("""
UPDATE approvals SET status = 'pending', note = NULL, answer = NULL, decided_at = NULL
WHERE approval_id = ANY(:ids) AND status IN ('approved', 'rejected')
""")
_PAUSE_AGAIN = text("UPDATE runs SET status = 'awaiting-approval' WHERE session_id = :sid AND status = 'in-progress'")
_WITHDRAW_RUN = text(
    "UPDATE approvals SET status = 'withdrawn', decided_at = now() WHERE session_id = :sid AND status = 'pending'"
)
# The sweep's decisions, in one statement so they hold on an autocommit connection too. Run rows are locked
# before approval rows (the join needs the run row before the approval row reaches the lock), the order
# resolve and delete take them in; both are skipped when another transaction holds them, so two sweeps never
# wait on each other or decide one approval twice, and a run a decision holds is left for the next pass. An
# approval whose run no longer waits on it (or is gone) is withdrawn, as resolve does.
_EXPIRE_DUE = text(f"""
WITH due AS MATERIALIZED (
  SELECT approval_id, session_id FROM approvals WHERE status = 'pending' AND expires_at <= now()
  ORDER BY expires_at, approval_id LIMIT :limit
),
run AS MATERIALIZED (
  SELECT session_id, status, document -> 'approval_ids' AS ids FROM runs
  WHERE session_id IN (SELECT session_id FROM due) FOR UPDATE SKIP LOCKED
),
picked AS MATERIALIZED (
  SELECT a.approval_id,
    COALESCE(r.status = 'awaiting-approval' AND r.ids @> jsonb_build_array(a.approval_id), false) AS waited
  FROM approvals a LEFT JOIN run r ON r.session_id = a.session_id
  WHERE a.approval_id IN (SELECT approval_id FROM due) AND a.status = 'pending' AND a.expires_at <= now()
    AND (r.session_id IS NOT NULL OR NOT EXISTS (SELECT 1 FROM runs gone WHERE gone.session_id = a.session_id))
  FOR UPDATE OF a SKIP LOCKED
)
UPDATE approvals SET status = CASE WHEN picked.waited THEN 'rejected' ELSE 'withdrawn' END,
  note = CASE WHEN picked.waited THEN {_NOTE_OF_EXPIRY} END, answer = NULL, decided_at = now()
FROM picked WHERE approvals.approval_id = picked.approval_id
RETURNING approvals.session_id, approvals.status
""")
# A statement of its own, so it sees every decision committed before it: the first statement's snapshot may
# predate a resolve of another approval of the run that committed before the sweep locked the run. An expiry is
# no person acting on the run: unlike a decision it keeps the run's error, so a run a step refused (its
# decisions put back, then expired again) stays parked until resume() instead of being refused at every pass.
_CONTINUE_EXPIRED = text("""
UPDATE runs SET status = 'in-progress'
WHERE session_id = ANY(:sids) AND status = 'awaiting-approval'
  AND NOT EXISTS (SELECT 1 FROM approvals a
                  WHERE runs.document -> 'approval_ids' @> jsonb_build_array(a.approval_id) AND a.status = 'pending')
""")


def insert(conn: Connection, approvals: Sequence[Approval]) -> None:
    """Create approval rows inside the caller's transaction (the pausing save's)."""
    conn.execute(
        _INSERT,
        [
            {
                "approval_id": a.approval_id,
                "session_id": a.session_id,
                "tool_call_id": a.tool_call_id,
                "tool_name": a.tool_name,
                "args": payloads.dumps(payloads.sanitize(a.args)),
                "agent": a.agent,
                "fingerprint": payloads.dumps(a.fingerprint),
                "kind": a.kind,
                "question": a.question,
                "options": None if a.options is None else payloads.dumps(a.options),
                "expires_in": a.expires_in,
            }
            for a in approvals
        ],
    )


def withdraw_for_run(conn: Connection, session_id: str) -> None:
    """Withdraw the pending approvals of a run being deleted (inside the caller's transaction)."""
    conn.execute(_WITHDRAW_RUN, {"sid": session_id})


def put_back(conn: Connection, session_id: str, approval_ids: Sequence[str]) -> None:
    """Return decided approvals to pending and their run to awaiting approval (caller's transaction)."""
    conn.execute(_UNDECIDE, {"ids": list(approval_ids)})
    conn.execute(_PAUSE_AGAIN, {"sid": session_id})


def expire_due(conn: Connection, limit: int) -> int:
    """Reject up to ``limit`` pending approvals past their ``expires_at``, oldest expiry first.

    Each gets the note ``EXPIRED_NOTE`` + its expiry time; a run left with no pending approval continues as
    after a person's last decision (``updated_at`` is left alone, so the recovery sweep finds it stale at
    once), except that a parked run keeps its error and waits for ``resume()``. Works on the caller's
    connection, in a transaction or not.

    Returns:
        How many approvals were taken off pending: rejected, or withdrawn because their run no longer waits.
    """
    decided = conn.execute(_EXPIRE_DUE, {"limit": limit}).all()
    rejected = sorted({row.session_id for row in decided if row.status == "rejected"})
    if rejected:
        conn.execute(_CONTINUE_EXPIRED, {"sids": rejected})
    return len(decided)


def _decide(
    conn: Connection, approval: Approval, approved: bool | None, note: str | None, answer: str | None
) -> tuple[Approval, bool]:
    """Record a decision on a locked, pending approval its run waits on; the approval as decided, and if expired.

    Past ``expires_at`` (Postgres's clock, as for the sweep) the expiry's rejection is recorded instead.

    Raises:
        ConfigurationError: the decision does not fit the approval's kind (``inputs.decision_status``).
    """
    expired = conn.execute(_EXPIRE_ONE, {"id": approval.approval_id}).first()
    if expired is not None:
        return approval.model_copy(update={"status": "rejected", "note": expired.note, "answer": None}), True
    status, answer = inputs.decision_status(approval.kind, approved, answer)
    conn.execute(_DECIDE, {"id": approval.approval_id, "status": status, "note": note, "answer": answer})
    return approval.model_copy(update={"status": status, "note": note, "answer": answer}), False


def _approval(row: Any) -> Approval:
    return Approval.model_validate(dict(row._mapping))


class PostgresApprovalStore:
    """Reads and decisions on approval rows."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def by_ids(self, approval_ids: Sequence[str]) -> dict[str, Approval]:
        """Approvals by id (missing ids are left out)."""
        if not approval_ids:
            return {}
        with Transaction(self.engine) as conn:
            rows = conn.execute(_BY_IDS, {"ids": list(approval_ids)}).all()
        return {row.approval_id: _approval(row) for row in rows}

    def pending(self, agent: str | None = None, limit: int = 1000) -> builtins.list[Approval]:
        """Undecided approvals, oldest first."""
        where = "status = 'pending'" + (" AND agent = :agent" if agent is not None else "")
        query = text(f"SELECT {_COLUMNS} FROM approvals WHERE {where} ORDER BY created_at, approval_id LIMIT :limit")
        with Transaction(self.engine) as conn:
            rows = conn.execute(query, {"agent": agent, "limit": limit}).all()
        return [_approval(row) for row in rows]

    def resolve(
        self, approval_id: str, approved: bool | None = None, note: str | None = None, answer: str | None = None
    ) -> Decision:
        """Decide an approval once: approve or reject a tool call, answer or decline a question.

        Raises:
            ApprovalNotFoundError: unknown, or already decided.
            ApprovalExpiredError: past its ``expires_at``; it was recorded as rejected (with a note saying so,
                and the run continues as after any last decision) and this decision was not.
            ApprovalOrphanedError: its run is gone, replaced or waits on other approvals; it is
                withdrawn (or was already) and nothing runs.
            ConfigurationError: the decision does not fit the approval's kind (``inputs.decision_status``).
        """
        note = inputs.clean_note(note)
        orphaned = expired = False
        with Transaction(self.engine) as conn:
            # The run row is locked before the approval row, the order delete() takes them in, so a
            # resolve racing a delete waits instead of deadlocking. An approval never changes run.
            owner = conn.execute(_SESSION_OF, {"id": approval_id}).scalar()
            if owner is not None:
                conn.execute(_LOCK_RUN, {"sid": owner}).first()
            row = conn.execute(_LOCK_APPROVAL, {"id": approval_id}).first()
            if row is not None and row.status == "withdrawn":
                raise errors.ApprovalOrphanedError(
                    f"approval {approval_id!r} was withdrawn: its run was deleted or replaced",
                    approval_id=approval_id,
                    session_id=row.session_id,
                )
            if row is None or row.status != "pending":
                state = "unknown" if row is None else f"already {row.status}"
                raise errors.ApprovalNotFoundError(f"approval {approval_id!r} is {state}")
            approval = _approval(row)
            run = conn.execute(_LOCK_RUN, {"sid": approval.session_id}).first()
            if run is None or run.status != "awaiting-approval" or approval_id not in (run.ids or []):
                conn.execute(_DECIDE, {"id": approval_id, "status": "withdrawn", "note": None, "answer": None})
                orphaned = True
            else:
                decided, expired = _decide(conn, approval, approved, note, answer)
                waiting = int(conn.execute(_STILL_PENDING, {"ids": list(run.ids)}).scalar_one())
                if waiting == 0:
                    conn.execute(_CONTINUE_RUN, {"sid": approval.session_id})
        if orphaned:
            raise errors.ApprovalOrphanedError(
                f"approval {approval_id!r} belongs to a run that no longer waits on it; it was withdrawn",
                approval_id=approval_id,
                session_id=approval.session_id,
            )
        if expired:
            raise errors.ApprovalExpiredError(
                f"approval {approval_id!r} expired before this decision; it was recorded as rejected"
                f" with the note {decided.note!r}"
            )
        return Decision(decided, waiting == 0)
