"""Approval rows in memory: created with a pausing save, listed, decided once, withdrawn, expired (``store.approvals``).

The row functions are called by the memory checkpoint store with the state's lock held, as the Postgres
ones run in the caller's transaction; ``MemoryApprovalStore`` is the reads and decisions of producers.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Protocol

from store import errors, inputs, payloads, records
from store.approvals import EXPIRED_NOTE
from store.memory.state import MemoryState, RunRow


def insert(state: MemoryState, approvals: Sequence[records.Approval], now: datetime) -> None:
    """Create approval rows for a pausing save (an id seen before is left as it is).

    An approval opened with ``expires_in`` expires that many seconds from ``now``.
    """
    for approval in approvals:
        expires_at = None if approval.expires_in is None else now + timedelta(seconds=approval.expires_in)
        stored = approval.model_copy(
            update={
                "args": payloads.sanitize(approval.args),
                "created_at": now,
                "status": "pending",
                "note": None,
                "decided_at": None,
                "expires_at": expires_at,
                "expires_in": None,
            }
        )
        state.approvals.setdefault(approval.approval_id, stored)


def expire_due(state: MemoryState, now: datetime, limit: int) -> int:
    """Reject up to ``limit`` pending approvals past their ``expires_at`` (see ``store.approvals.expire_due``).

    Returns:
        How many approvals were taken off pending: rejected, or withdrawn because their run no longer waits.
    """
    due = sorted(
        (
            a
            for a in state.approvals.values()
            if a.status == "pending" and a.expires_at is not None and a.expires_at <= now
        ),
        key=lambda a: (a.expires_at, a.approval_id),
    )[:limit]
    touched: dict[str, RunRow] = {}
    for approval in due:
        run = state.runs.get(approval.session_id)
        if run is not None and _waits_on(run, approval.approval_id):
            state.approvals[approval.approval_id] = _expired(approval, now)
            touched[approval.session_id] = run
        else:
            state.approvals[approval.approval_id] = approval.model_copy(
                update={"status": "withdrawn", "note": None, "answer": None, "decided_at": now}
            )
    for run in touched.values():
        _continue_if_decided(state, run, by_person=False)
    return len(due)


def _waits_on(run: RunRow, approval_id: str) -> bool:
    """Whether ``run`` is paused on ``approval_id`` (else a decision on it withdraws it)."""
    return run.status == "awaiting-approval" and approval_id in run.waiting_on()


def _expired(approval: records.Approval, now: datetime) -> records.Approval:
    """``approval`` as its expiry decides it: rejected, with the note ``store.approvals`` writes."""
    assert approval.expires_at is not None  # only expired approvals get here
    stamp = approval.expires_at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f+00:00")
    return approval.model_copy(
        update={"status": "rejected", "note": EXPIRED_NOTE + stamp, "answer": None, "decided_at": now}
    )


def _continue_if_decided(state: MemoryState, run: RunRow, *, by_person: bool = True) -> bool:
    """Let ``run`` continue when none of the approvals it waits on is pending; whether it may.

    A person's decision also clears the run's error; an expiry keeps it (a parked run waits for ``resume()``).
    """
    waiting = sum(1 for a in run.waiting_on() if a in state.approvals and state.approvals[a].status == "pending")
    if waiting == 0:
        run.status = "in-progress"
        if by_person:
            run.last_error, run.attempts = None, 0
    return waiting == 0


def put_back(state: MemoryState, approval_ids: Sequence[str]) -> None:
    """Return decided approvals to pending (a refused step will act on them again)."""
    for approval_id in approval_ids:
        approval = state.approvals.get(approval_id)
        if approval is not None and approval.status in ("approved", "rejected"):
            state.approvals[approval_id] = approval.model_copy(
                update={"status": "pending", "note": None, "answer": None, "decided_at": None}
            )


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
            found = [
                a
                for a in self._state.approvals.values()
                if a.status == "pending" and (agent is None or a.agent == agent)
            ]
        return sorted(found, key=lambda a: (a.created_at or datetime.min.replace(tzinfo=UTC), a.approval_id))[:limit]

    def resolve(
        self, approval_id: str, approved: bool | None = None, note: str | None = None, answer: str | None = None
    ) -> records.Decision:
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
        state = self._state
        with state.lock:
            approval = state.approvals.get(approval_id)
            if approval is not None and approval.status == "withdrawn":
                raise errors.ApprovalOrphanedError(
                    f"approval {approval_id!r} was withdrawn: its run was deleted or replaced",
                    approval_id=approval_id,
                    session_id=approval.session_id,
                )
            if approval is None or approval.status != "pending":
                found = "unknown" if approval is None else f"already {approval.status}"
                raise errors.ApprovalNotFoundError(f"approval {approval_id!r} is {found}")
            now = state.clock()
            run = state.runs.get(approval.session_id)
            if run is None or not _waits_on(run, approval_id):
                state.approvals[approval_id] = approval.model_copy(
                    update={"status": "withdrawn", "note": None, "decided_at": now}
                )
                raise errors.ApprovalOrphanedError(
                    f"approval {approval_id!r} belongs to a run that no longer waits on it; it was withdrawn",
                    approval_id=approval_id,
                    session_id=approval.session_id,
                )
            if approval.expires_at is not None and approval.expires_at <= now:
                expired = state.approvals[approval_id] = _expired(approval, now)
                _continue_if_decided(state, run)
                raise errors.ApprovalExpiredError(
                    f"approval {approval_id!r} expired before this decision; it was recorded as rejected"
                    f" with the note {expired.note!r}"
                )
            status, answer = inputs.decision_status(approval.kind, approved, answer)
            decided = {"status": status, "note": note, "answer": answer}
            state.approvals[approval_id] = approval.model_copy(update={**decided, "decided_at": now})
            continues = _continue_if_decided(state, run)
            return records.Decision(approval.model_copy(update=decided), continues)
