"""Approval records in Postgres: create with the pausing save, list, decide once, withdraw.

A decision is taken under row locks of the approval and its run, so concurrent resolves of one
approval decide it once, and an approval whose run no longer waits on it is withdrawn.
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

__all__ = ["PostgresApprovalStore", "insert", "put_back", "withdraw_for_run"]

_COLUMNS = ("approval_id, session_id, tool_call_id, tool_name, args, agent, status, note, fingerprint,"
            " created_at, decided_at, kind, question, options, answer")
_INSERT = text("""
INSERT INTO approvals (approval_id, session_id, tool_call_id, tool_name, args, agent, fingerprint, kind, question,
  options)
VALUES (:approval_id, :session_id, :tool_call_id, :tool_name, CAST(:args AS jsonb), :agent, CAST(:fingerprint AS jsonb),
  :kind, :question, CAST(:options AS jsonb))
ON CONFLICT (approval_id) DO NOTHING
""")
_BY_IDS = text(f"SELECT {_COLUMNS} FROM approvals WHERE approval_id = ANY(:ids)")
_SESSION_OF = text("SELECT session_id FROM approvals WHERE approval_id = :id")
_LOCK_APPROVAL = text(f"SELECT {_COLUMNS} FROM approvals WHERE approval_id = :id FOR UPDATE")
_LOCK_RUN = text("SELECT status, document -> 'approval_ids' AS ids FROM runs WHERE session_id = :sid FOR UPDATE")
_DECIDE = text("UPDATE approvals SET status = :status, note = :note, answer = :answer, decided_at = now()"
               " WHERE approval_id = :id")
_STILL_PENDING = text("SELECT count(*) FROM approvals WHERE approval_id = ANY(:ids) AND status = 'pending'")
# Leave updated_at alone: the sweep then sees the run as stale at once if the enqueue is lost.
_CONTINUE_RUN = text(
    "UPDATE runs SET status = 'in-progress', last_error = NULL, attempts = 0 WHERE session_id = :sid")
_UNDECIDE = text("""
UPDATE approvals SET status = 'pending', note = NULL, answer = NULL, decided_at = NULL
WHERE approval_id = ANY(:ids) AND status IN ('approved', 'rejected')
""")
_PAUSE_AGAIN = text("UPDATE runs SET status = 'awaiting-approval' WHERE session_id = :sid AND status = 'in-progress'")
_WITHDRAW_RUN = text(
    "UPDATE approvals SET status = 'withdrawn', decided_at = now() WHERE session_id = :sid AND status = 'pending'")


def insert(conn: Connection, approvals: Sequence[Approval]) -> None:
    """Create approval rows inside the caller's transaction (the pausing save's)."""
    conn.execute(_INSERT, [
        {"approval_id": a.approval_id, "session_id": a.session_id, "tool_call_id": a.tool_call_id,
         "tool_name": a.tool_name, "args": payloads.dumps(payloads.sanitize(a.args)), "agent": a.agent,
         "fingerprint": payloads.dumps(a.fingerprint), "kind": a.kind, "question": a.question,
         "options": None if a.options is None else payloads.dumps(a.options)} for a in approvals])


def withdraw_for_run(conn: Connection, session_id: str) -> None:
    """Withdraw the pending approvals of a run being deleted (inside the caller's transaction)."""
    conn.execute(_WITHDRAW_RUN, {"sid": session_id})


def put_back(conn: Connection, session_id: str, approval_ids: Sequence[str]) -> None:
    """Return decided approvals to pending and their run to awaiting approval (caller's transaction)."""
    conn.execute(_UNDECIDE, {"ids": list(approval_ids)})
    conn.execute(_PAUSE_AGAIN, {"sid": session_id})


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

    def resolve(self, approval_id: str, approved: bool | None = None, note: str | None = None,
                answer: str | None = None) -> Decision:
        """Decide an approval once: approve or reject a tool call, answer or decline a question.

        Raises:
            ApprovalNotFoundError: unknown, or already decided.
            ApprovalOrphanedError: its run is gone, replaced or waits on other approvals; it is
                withdrawn (or was already) and nothing runs.
            ConfigurationError: the decision does not fit the approval's kind (``inputs.decision_status``).
        """
        note = inputs.clean_note(note)
        orphaned = False
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
                    approval_id=approval_id, session_id=row.session_id)
            if row is None or row.status != "pending":
                state = "unknown" if row is None else f"already {row.status}"
                raise errors.ApprovalNotFoundError(f"approval {approval_id!r} is {state}")
            approval = _approval(row)
            run = conn.execute(_LOCK_RUN, {"sid": approval.session_id}).first()
            if run is None or run.status != "awaiting-approval" or approval_id not in (run.ids or []):
                conn.execute(_DECIDE, {"id": approval_id, "status": "withdrawn", "note": None, "answer": None})
                orphaned = True
            else:
                status, answer = inputs.decision_status(approval.kind, approved, answer)
                conn.execute(_DECIDE, {"id": approval_id, "status": status, "note": note, "answer": answer})
                waiting = int(conn.execute(_STILL_PENDING, {"ids": list(run.ids)}).scalar_one())
                if waiting == 0:
                    conn.execute(_CONTINUE_RUN, {"sid": approval.session_id})
                decided = approval.model_copy(update={"status": status, "note": note, "answer": answer})
        if orphaned:
            raise errors.ApprovalOrphanedError(
                f"approval {approval_id!r} belongs to a run that no longer waits on it; it was withdrawn",
                approval_id=approval_id, session_id=approval.session_id)
        return Decision(decided, waiting == 0)
