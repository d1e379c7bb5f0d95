"""Approval rows in memory: created with a pausing save, listed, decided once, withdrawn (``store.approvals``).

The row functions are called by the memory checkpoint store with the state's lock held, as the Postgres
ones run in the caller's transaction; ``MemoryApprovalStore`` is the reads and decisions of producers.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Protocol

from store import errors, inputs, payloads, records
from store.memory.state import MemoryState


def insert(state: MemoryState, approvals: Sequence[records.Approval], now: datetime) -> None:
    """Create approval rows for a pausing save (an id seen before is left as it is)."""
    for approval in approvals:
        stored = approval.model_copy(update={"args": payloads.sanitize(approval.args), "created_at": now,
                                             "status": "pending", "note": None, "decided_at": None})
        state.approvals.setdefault(approval.approval_id, stored)


def put_back(state: MemoryState, approval_ids: Sequence[str]) -> None:
    """Return decided approvals to pending (a refused step will act on them again)."""
    for approval_id in approval_ids:
        approval = state.approvals.get(approval_id)
        if approval is not None and approval.status in ("approved", "rejected"):
            state.approvals[approval_id] = approval.model_copy(
                update={"status": "pending", "note": None, "answer": None, "decided_at": None})


def withdraw_for_run(state: MemoryState, session_id: str, now: datetime) -> None:
    """Withdraw the pending approvals of a run being deleted."""
    for approval_id, approval in state.approvals.items():
        if approval.session_id == session_id and approval.status == "pending":
            state.approvals[approval_id] = approval.model_copy(update={"status": "withdrawn", "decided_at": now})


def by_ids(state: MemoryState, approval_ids: Sequence[str]) -> dict[str, records.Approval]:
    """Approvals by id (missing ids are left out)."""
    return {a: state.approvals[a] for a in approval_ids if a in state.approvals}


class SharesState(Protocol):
    """A memory store whose tables the approval store reads and decides on (``MemoryCheckpointStore``)."""

    @property
    def state(self) -> MemoryState:
        """The tables of the in-memory database."""


class MemoryApprovalStore:
    """``PostgresApprovalStore`` semantics over the approvals of a memory checkpoint store."""

    def __init__(self, store: SharesState) -> None:
        self._state = store.state

    def by_ids(self, approval_ids: Sequence[str]) -> dict[str, records.Approval]:
        """Approvals by id (missing ids are left out)."""
        with self._state.lock:
            return by_ids(self._state, approval_ids)

    def pending(self, agent: str | None = None, limit: int = 1000) -> builtins.list[records.Approval]:
        """Undecided approvals, oldest first."""
        with self._state.lock:
            found = [a for a in self._state.approvals.values()
                     if a.status == "pending" and (agent is None or a.agent == agent)]
        return sorted(found, key=lambda a: (a.created_at or datetime.min.replace(tzinfo=UTC), a.approval_id))[:limit]

    def resolve(self, approval_id: str, approved: bool | None = None, note: str | None = None,
                answer: str | None = None) -> records.Decision:
        """Decide an approval once: approve or reject a tool call, answer or decline a question.

        Raises:
            ApprovalNotFoundError: unknown, or already decided.
            ApprovalOrphanedError: its run is gone, replaced or waits on other approvals; it is
                withdrawn (or was already) and nothing runs.
            ConfigurationError: the decision does not fit the approval's kind (``inputs.decision_status``).
        """
        note = inputs.clean_note(note)
        state = self._state
        with state.lock:
            approval = state.approvals.get(approval_id)
            if approval is not None and approval.status == "withdrawn":
                raise errors.ApprovalOrphanedError(
                    f"approval {approval_id!r} was withdrawn: its run was deleted or replaced",
                    approval_id=approval_id, session_id=approval.session_id)
            if approval is None or approval.status != "pending":
                found = "unknown" if approval is None else f"already {approval.status}"
                raise errors.ApprovalNotFoundError(f"approval {approval_id!r} is {found}")
            now = state.clock()
            run = state.runs.get(approval.session_id)
            waiting_on = run.waiting_on() if run is not None else []
            if run is None or run.status != "awaiting-approval" or approval_id not in waiting_on:
                state.approvals[approval_id] = approval.model_copy(
                    update={"status": "withdrawn", "note": None, "decided_at": now})
                raise errors.ApprovalOrphanedError(
                    f"approval {approval_id!r} belongs to a run that no longer waits on it; it was withdrawn",
                    approval_id=approval_id, session_id=approval.session_id)
            status, answer = inputs.decision_status(approval.kind, approved, answer)
            decided = {"status": status, "note": note, "answer": answer}
            state.approvals[approval_id] = approval.model_copy(update={**decided, "decided_at": now})
            waiting = sum(1 for a in waiting_on if a in state.approvals and state.approvals[a].status == "pending")
            if waiting == 0:
                run.status, run.last_error, run.attempts = "in-progress", None, 0
            return records.Decision(approval.model_copy(update=decided), waiting == 0)
