"""Contract checks of approvals: opened by a pausing write, decided once, withdrawn, put back."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from store import errors, interfaces
from store.records import Approval, Checkpoint, LastError, Message, ToolCall
from tests.fakes.store_contract.subject import (
    AGENT,
    StoreFactory,
    claimed_run,
    comparable,
    new_run,
    save_next,
    user_message,
    write,
)

# -- approvals ---------------------------------------------------------------------------------------


def _paused(store: interfaces.CheckpointStore, session_id: str, calls: int = 2) -> tuple[Checkpoint, list[Approval]]:
    """A run whose turn asked for ``calls`` gated calls, saved paused on one approval each."""
    checkpoint = new_run(store, session_id)
    turn = [ToolCall(id=f"{session_id}-c{k}", name="email", args={"to": f"t{k}", "n": 10**30}) for k in range(calls)]
    approvals = [Approval(approval_id=f"{session_id}-ap{k}", session_id=session_id, tool_call_id=call.id,
                          tool_name=call.name, args=call.args, agent=AGENT) for k, call in enumerate(turn)]
    paused = checkpoint.model_copy(update={
        "seq": 1, "messages": [user_message("email them"), Message(role="assistant", tool_calls=turn)], "step": 1,
        "status": "awaiting-approval", "approval_ids": [a.approval_id for a in approvals], "inbox_cursor": 1})
    assert write(store, paused, drained_inbox=True, approvals=approvals) is not None
    return paused, approvals


def check_a_pausing_save_creates_one_pending_approval_per_gated_call(make: StoreFactory) -> None:
    subject = make(50)
    _, approvals = _paused(subject.store, "ct-pause")
    found = subject.store.decisions([a.approval_id for a in approvals] + ["ct-pause-unknown"])
    assert sorted(found) == ["ct-pause-ap0", "ct-pause-ap1"]
    first = found["ct-pause-ap0"]
    assert (first.status, first.session_id, first.tool_call_id, first.tool_name) == (
        "pending", "ct-pause", "ct-pause-c0", "email")
    assert first.args == {"to": "t0", "n": 10**30} and first.created_at is not None
    listed = [a.approval_id for a in subject.approvals.pending(AGENT) if a.session_id == "ct-pause"]
    assert listed == ["ct-pause-ap0", "ct-pause-ap1"]
    assert [a for a in subject.approvals.pending("another-agent") if a.session_id == "ct-pause"] == []
    assert subject.store.decisions([]) == {}


def check_the_last_decision_of_a_pause_lets_the_run_continue(make: StoreFactory) -> None:
    subject = make(50)
    _paused(subject.store, "ct-decide")
    first = subject.approvals.resolve("ct-decide-ap0", approved=True, note="ok\x00")
    assert first.run_continues is False and first.approval.status == "approved"
    loaded = subject.store.load("ct-decide")
    assert loaded is not None and loaded.status == "awaiting-approval"
    second = subject.approvals.resolve("ct-decide-ap1", approved=False, note="not this one")
    assert second.run_continues is True and second.approval.status == "rejected"
    loaded = subject.store.load("ct-decide")
    assert loaded is not None and (loaded.status, loaded.attempts, loaded.last_error) == ("in-progress", 0, None)
    decided = subject.store.decisions(["ct-decide-ap0", "ct-decide-ap1"])
    assert (decided["ct-decide-ap0"].status, decided["ct-decide-ap0"].note) == ("approved", "ok\ufffd")
    assert (decided["ct-decide-ap1"].status, decided["ct-decide-ap1"].note) == ("rejected", "not this one")
    assert decided["ct-decide-ap1"].decided_at is not None
    with pytest.raises(errors.ApprovalNotFoundError):
        subject.approvals.resolve("ct-decide-ap0", approved=True)
    with pytest.raises(errors.ApprovalNotFoundError):
        subject.approvals.resolve("ct-decide-unknown", approved=True)


def check_an_approval_of_a_deleted_run_is_withdrawn_and_orphaned(make: StoreFactory) -> None:
    subject = make(50)
    _paused(subject.store, "ct-orphan")
    assert subject.store.delete("ct-orphan")
    assert subject.store.decisions(["ct-orphan-ap0"])["ct-orphan-ap0"].status == "withdrawn"
    for _ in range(2):
        with pytest.raises(errors.ApprovalOrphanedError):
            subject.approvals.resolve("ct-orphan-ap0", approved=True)
    assert [a for a in subject.approvals.pending() if a.session_id == "ct-orphan"] == []


def check_an_approval_the_run_no_longer_waits_on_is_withdrawn_when_resolved(make: StoreFactory) -> None:
    subject = make(50)
    paused, _ = _paused(subject.store, "ct-replaced")
    # The run moved on without this decision (a fork of an older step, a refusal...): it is stale.
    moved = claimed_run(subject.store, "ct-replaced", 2)
    save_next(subject.store, moved, status="in-progress", approval_ids=[])
    with pytest.raises(errors.ApprovalOrphanedError):
        subject.approvals.resolve("ct-replaced-ap0", approved=True)
    assert subject.store.decisions(["ct-replaced-ap0"])["ct-replaced-ap0"].status == "withdrawn"
    loaded = subject.store.load("ct-replaced")
    assert loaded is not None and loaded.status == "in-progress" and loaded.seq == paused.seq + 1


def check_refuse_parks_the_run_and_puts_its_decisions_back(make: StoreFactory) -> None:
    subject = make(50)
    paused, approvals = _paused(subject.store, "ct-refuse", calls=1)
    subject.approvals.resolve("ct-refuse-ap0", approved=True)
    holder = claimed_run(subject.store, "ct-refuse", 2)
    error = LastError(code="LOUSHO_AGENT_DRIFT", message="tools changed", retryable=True)
    assert subject.store.refuse("ct-refuse", 1, error, ["ct-refuse-ap0"]) is False      # fenced out
    assert subject.store.refuse("ct-refuse", holder.fence, error, ["ct-refuse-ap0"]) is True
    loaded = subject.store.load("ct-refuse")
    assert loaded is not None
    assert loaded.last_error == error.model_copy(update={"retryable": False})
    assert loaded.status == "awaiting-approval" and comparable(loaded) == comparable(
        paused.model_copy(update={"fence": holder.fence}))
    back = subject.store.decisions(["ct-refuse-ap0"])["ct-refuse-ap0"]
    assert (back.status, back.note, back.decided_at) == ("pending", None, None)
    assert [a.approval_id for a in approvals] == ["ct-refuse-ap0"]


CHECKS: tuple[Callable[[StoreFactory], None], ...] = (
    check_a_pausing_save_creates_one_pending_approval_per_gated_call,
    check_the_last_decision_of_a_pause_lets_the_run_continue,
    check_an_approval_of_a_deleted_run_is_withdrawn_and_orphaned,
    check_an_approval_the_run_no_longer_waits_on_is_withdrawn_when_resolved,
    check_refuse_parks_the_run_and_puts_its_decisions_back,
)
