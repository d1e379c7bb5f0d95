"""Contract checks of approvals: opened by a pausing write, decided once, withdrawn, put back, expired."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

import pytest

from store import errors, interfaces
from store.approvals import EXPIRED_NOTE
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


def _paused(
    store: interfaces.CheckpointStore, session_id: str, calls: int = 2, expires_in: Sequence[float | None] = ()
) -> tuple[Checkpoint, list[Approval]]:
    """A run whose turn asked for ``calls`` gated calls, saved paused on one approval each.

    ``expires_in[k]`` is the expiry of approval ``k`` in seconds (none when missing or None).
    """
    checkpoint = new_run(store, session_id)
    turn = [ToolCall(id=f"{session_id}-c{k}", name="email", args={"to": f"t{k}", "n": 10**30}) for k in range(calls)]
    expiries = [*expires_in, *[None] * calls][:calls]
    approvals = [
        Approval(
            approval_id=f"{session_id}-ap{k}",
            session_id=session_id,
            tool_call_id=call.id,
            tool_name=call.name,
            args=call.args,
            agent=AGENT,
            expires_in=expiries[k],
        )
        for k, call in enumerate(turn)
    ]
    paused = checkpoint.model_copy(
        update={
            "seq": 1,
            "messages": [user_message("email them"), Message(role="assistant", tool_calls=turn)],
            "step": 1,
            "status": "awaiting-approval",
            "approval_ids": [a.approval_id for a in approvals],
            "inbox_cursor": 1,
        }
    )
    assert write(store, paused, drained_inbox=True, approvals=approvals) is not None
    return paused, approvals


def check_a_pausing_save_creates_one_pending_approval_per_gated_call(make: StoreFactory) -> None:
    subject = make(50)
    _, approvals = _paused(subject.store, "ct-pause")
    found = subject.store.decisions([a.approval_id for a in approvals] + ["ct-pause-unknown"])
    assert sorted(found) == ["ct-pause-ap0", "ct-pause-ap1"]
    first = found["ct-pause-ap0"]
    assert (first.status, first.session_id, first.tool_call_id, first.tool_name) == (
        "pending",
        "ct-pause",
        "ct-pause-c0",
        "email",
    )
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


def _status(store: interfaces.CheckpointStore, session_id: str) -> str | None:
    loaded = store.load(session_id)
    return None if loaded is None else loaded.status


def check_a_decision_made_while_a_step_of_the_paused_run_held_it_stands_through_the_steps_paused_save(
    make: StoreFactory,
) -> None:
    subject = make(50)
    _paused(subject.store, "ct-meanwhile", calls=1)
    step = claimed_run(subject.store, "ct-meanwhile", 2)  # a step of the paused run begins (a child's result, say)
    assert subject.approvals.resolve("ct-meanwhile-ap0", approved=True).run_continues  # the run continues meanwhile
    # The step saves the run paused, from the approvals it read before the decision
    assert write(subject.store, step.model_copy(update={"seq": step.seq + 1}), paused_before=True) is not None
    assert _status(subject.store, "ct-meanwhile") == "in-progress", "the step's save undid the decision"

    # Without a decision meanwhile such a save keeps the run paused, and a step that began in progress pauses it
    _paused(subject.store, "ct-still", calls=1)
    step = claimed_run(subject.store, "ct-still", 2)
    assert write(subject.store, step.model_copy(update={"seq": step.seq + 1}), paused_before=True) is not None
    assert _status(subject.store, "ct-still") == "awaiting-approval"
    running = new_run(subject.store, "ct-pausing")
    paused = running.model_copy(update={"seq": running.seq + 1, "status": "awaiting-approval", "inbox_cursor": 1})
    assert write(subject.store, paused, drained_inbox=True) is not None
    assert _status(subject.store, "ct-pausing") == "awaiting-approval"


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
    assert subject.store.refuse("ct-refuse", 1, error, ["ct-refuse-ap0"]) is False  # fenced out
    assert subject.store.refuse("ct-refuse", holder.fence, error, ["ct-refuse-ap0"]) is True
    loaded = subject.store.load("ct-refuse")
    assert loaded is not None
    assert loaded.last_error == error.model_copy(update={"retryable": False})
    assert loaded.status == "awaiting-approval" and comparable(loaded) == comparable(
        paused.model_copy(update={"fence": holder.fence})
    )
    back = subject.store.decisions(["ct-refuse-ap0"])["ct-refuse-ap0"]
    assert (back.status, back.note, back.decided_at) == ("pending", None, None)
    assert [a.approval_id for a in approvals] == ["ct-refuse-ap0"]


# -- expiry ------------------------------------------------------------------------------------------

#: Seconds an approval waits in the expiry checks before it is due: one ``tick`` of the subject passes it.
_SOON = 0.001
#: Seconds an approval waits in the expiry checks that must not expire while they run.
_LATER = 3600.0


def _expired_at(approval: Approval) -> datetime:
    """The expiry time an expired approval's note names (and checks that the note says it expired)."""
    assert approval.note is not None and approval.note.startswith(EXPIRED_NOTE), approval.note
    return datetime.fromisoformat(approval.note.removeprefix(EXPIRED_NOTE))


def check_an_approval_opened_with_expires_in_expires_that_long_after_it_was_opened(make: StoreFactory) -> None:
    subject = make(50)
    _paused(subject.store, "ct-expiry", expires_in=[_LATER])
    opened = subject.store.decisions(["ct-expiry-ap0", "ct-expiry-ap1"])
    first, second = opened["ct-expiry-ap0"], opened["ct-expiry-ap1"]
    assert first.created_at is not None and first.expires_at == first.created_at + timedelta(seconds=_LATER)
    assert second.expires_at is None and first.expires_in is None
    listed = {a.approval_id: a.expires_at for a in subject.approvals.pending(AGENT) if a.session_id == "ct-expiry"}
    assert listed == {"ct-expiry-ap0": first.expires_at, "ct-expiry-ap1": None}
    assert subject.store.expire_approvals() == 0
    assert subject.approvals.resolve("ct-expiry-ap0", approved=True).approval.status == "approved"


def check_a_decision_after_the_expiry_is_refused_and_the_expiry_rejects_the_approval(make: StoreFactory) -> None:
    subject = make(50)
    _paused(subject.store, "ct-late", expires_in=[_SOON])
    subject.tick()
    with pytest.raises(errors.ApprovalExpiredError) as refused:
        subject.approvals.resolve("ct-late-ap0", approved=True, note="yes, go")
    assert refused.value.code == "LOUSHO_APPROVAL_EXPIRED" and "expired" in refused.value.message
    late = subject.store.decisions(["ct-late-ap0"])["ct-late-ap0"]
    assert (late.status, late.answer) == ("rejected", None) and late.decided_at is not None
    assert _expired_at(late) == late.expires_at
    loaded = subject.store.load("ct-late")
    assert loaded is not None and loaded.status == "awaiting-approval"  # the other approval still waits
    assert subject.approvals.resolve("ct-late-ap1", approved=True).run_continues is True
    loaded = subject.store.load("ct-late")
    assert loaded is not None and loaded.status == "in-progress"
    with pytest.raises(errors.ApprovalNotFoundError) as again:
        subject.approvals.resolve("ct-late-ap0", approved=True)
    assert type(again.value) is errors.ApprovalNotFoundError  # decided now: no longer "expired"


def check_a_late_decision_that_was_the_last_one_lets_the_run_continue(make: StoreFactory) -> None:
    subject = make(50)
    _paused(subject.store, "ct-late-last", calls=1, expires_in=[_SOON])
    subject.tick()
    with pytest.raises(errors.ApprovalExpiredError):
        subject.approvals.resolve("ct-late-last-ap0", approved=False, note="no")
    assert subject.store.decisions(["ct-late-last-ap0"])["ct-late-last-ap0"].status == "rejected"
    loaded = subject.store.load("ct-late-last")
    assert loaded is not None and (loaded.status, loaded.attempts, loaded.last_error) == ("in-progress", 0, None)


def check_expire_approvals_decides_due_ones_only_oldest_first_and_continues_their_runs(make: StoreFactory) -> None:
    subject = make(50)
    store = subject.store
    _paused(store, "ct-exp-a", expires_in=[_SOON, _SOON])
    subject.tick()
    _paused(store, "ct-exp-b", expires_in=[_SOON, None])  # one approval never expires
    _paused(store, "ct-exp-c", calls=1, expires_in=[_LATER])  # not due
    _paused(store, "ct-exp-gone", calls=1, expires_in=[_SOON])
    moved = claimed_run(store, "ct-exp-gone", 2)
    save_next(store, moved, status="in-progress", approval_ids=[])  # the run no longer waits on it
    paused_at = store.load("ct-exp-a")
    assert paused_at is not None
    subject.tick()

    assert store.expire_approvals(1) == 1  # bounded; the oldest expiry goes first
    decided = store.decisions(["ct-exp-a-ap0", "ct-exp-a-ap1"])
    assert (decided["ct-exp-a-ap0"].status, decided["ct-exp-a-ap1"].status) == ("rejected", "pending")
    loaded = store.load("ct-exp-a")
    assert loaded is not None and loaded.status == "awaiting-approval"

    assert store.expire_approvals(100) == 3
    assert store.expire_approvals(100) == 0
    found = store.decisions(["ct-exp-a-ap1", "ct-exp-b-ap0", "ct-exp-b-ap1", "ct-exp-c-ap0", "ct-exp-gone-ap0"])
    assert {k: a.status for k, a in found.items()} == {
        "ct-exp-a-ap1": "rejected",
        "ct-exp-b-ap0": "rejected",
        "ct-exp-b-ap1": "pending",
        "ct-exp-c-ap0": "pending",
        "ct-exp-gone-ap0": "withdrawn",
    }
    for approval in (decided["ct-exp-a-ap0"], found["ct-exp-a-ap1"], found["ct-exp-b-ap0"]):
        assert _expired_at(approval) == approval.expires_at and approval.answer is None
    runs = {sid: store.load(sid) for sid in ("ct-exp-a", "ct-exp-b", "ct-exp-c", "ct-exp-gone")}
    assert {sid: c.status for sid, c in runs.items() if c is not None} == {
        "ct-exp-a": "in-progress",
        "ct-exp-b": "awaiting-approval",
        "ct-exp-c": "awaiting-approval",
        "ct-exp-gone": "in-progress",
    }
    continued = runs["ct-exp-a"]
    assert continued is not None and continued.updated_at == paused_at.updated_at  # stale for the sweep at once
    assert (continued.attempts, continued.last_error) == (0, None)
    assert [a.approval_id for a in subject.approvals.pending(AGENT)] == ["ct-exp-b-ap1", "ct-exp-c-ap0"]


def check_an_expiry_keeps_a_refused_run_parked_until_resume(make: StoreFactory) -> None:
    subject = make(50)
    store = subject.store
    _paused(store, "ct-exp-park", calls=1, expires_in=[_SOON])
    subject.tick()
    assert store.expire_approvals() == 1
    # A step acting on the expiry's rejection is refused (its agent drifted): the decision is put back.
    holder = claimed_run(store, "ct-exp-park", 2)
    error = LastError(code="LOUSHO_AGENT_DRIFT", message="tools changed", retryable=False)
    assert store.refuse("ct-exp-park", holder.fence, error, ["ct-exp-park-ap0"]) is True
    assert store.decisions(["ct-exp-park-ap0"])["ct-exp-park-ap0"].status == "pending"

    assert store.expire_approvals() == 1  # expired still: rejected again
    subject.tick()
    loaded = store.load("ct-exp-park")
    assert loaded is not None and (loaded.status, loaded.last_error) == ("in-progress", error)
    assert "ct-exp-park" not in [r.session_id for r in store.due_runs(0.0)]  # parked: not refused at every pass
    assert store.reset_attempts("ct-exp-park") is not None  # resume()
    subject.tick()
    assert "ct-exp-park" in [r.session_id for r in store.due_runs(0.0)]


def check_two_concurrent_expiry_passes_decide_each_approval_once(make: StoreFactory) -> None:
    subject = make(50)
    runs = [f"ct-exp-race-{k}" for k in range(12)]
    for session_id in runs:
        _paused(subject.store, session_id, expires_in=[_SOON, _SOON])
    subject.tick()
    start = threading.Barrier(2)
    counts: list[int] = []

    def sweep() -> None:
        start.wait(timeout=10)
        counts.extend(subject.store.expire_approvals(5) for _ in range(6))

    passes = [threading.Thread(target=sweep) for _ in range(2)]
    for thread in passes:
        thread.start()
    for thread in passes:
        thread.join(timeout=30)
    counts.append(subject.store.expire_approvals(100))  # whatever both skipped as locked

    assert sum(counts) == 2 * len(runs)
    decided = subject.store.decisions([f"{sid}-ap{k}" for sid in runs for k in range(2)])
    assert {a.status for a in decided.values()} == {"rejected"}
    assert all(c is not None and c.status == "in-progress" for c in map(subject.store.load, runs))


def check_a_reconciliation_keeps_its_kind_and_question_and_is_answered_approved_or_rejected(make: StoreFactory) -> None:
    subject = make(50)
    decisions: dict[str, dict[str, Any]] = {
        "ct-rec-a": {"answer": "charged as ch_7"},
        "ct-rec-b": {"approved": True},
        "ct-rec-c": {"approved": False, "note": "refunded"},
    }
    for session_id in decisions:
        checkpoint = new_run(subject.store, session_id)
        call = ToolCall(id=f"{session_id}-c0", name="charge", args={"order": "7"})
        asked = Approval(
            approval_id=f"{session_id}-ap0",
            session_id=session_id,
            tool_call_id=call.id,
            tool_name="charge",
            args=call.args,
            agent=AGENT,
            kind="reconcile",
            question="Did it take effect?",
        )
        paused = checkpoint.model_copy(
            update={
                "seq": 1,
                "messages": [user_message("charge"), Message(role="assistant", tool_calls=[call])],
                "step": 1,
                "status": "awaiting-approval",
                "approval_ids": [asked.approval_id],
                "inbox_cursor": 1,
                "started_tool_call_ids": [call.id],
            }
        )
        assert write(subject.store, paused, drained_inbox=True, approvals=[asked]) is not None
    listed = {a.session_id: a for a in subject.approvals.pending(AGENT) if a.session_id in decisions}
    assert {(a.kind, a.question, a.expires_at) for a in listed.values()} == {("reconcile", "Did it take effect?", None)}
    with pytest.raises(errors.ConfigurationError):
        subject.approvals.resolve("ct-rec-a-ap0", approved=False, answer="both")
    decided = {sid: subject.approvals.resolve(f"{sid}-ap0", **how) for sid, how in decisions.items()}
    assert {sid: (d.approval.status, d.approval.answer, d.run_continues) for sid, d in decided.items()} == {
        "ct-rec-a": ("approved", "charged as ch_7", True),
        "ct-rec-b": ("approved", None, True),
        "ct-rec-c": ("rejected", None, True),
    }
    loaded = subject.store.load("ct-rec-a")
    assert loaded is not None and (loaded.status, loaded.started_tool_call_ids) == ("in-progress", ["ct-rec-a-c0"])


CHECKS: tuple[Callable[[StoreFactory], None], ...] = (
    check_a_pausing_save_creates_one_pending_approval_per_gated_call,
    check_the_last_decision_of_a_pause_lets_the_run_continue,
    check_a_decision_made_while_a_step_of_the_paused_run_held_it_stands_through_the_steps_paused_save,
    check_an_approval_of_a_deleted_run_is_withdrawn_and_orphaned,
    check_an_approval_the_run_no_longer_waits_on_is_withdrawn_when_resolved,
    check_refuse_parks_the_run_and_puts_its_decisions_back,
    check_an_approval_opened_with_expires_in_expires_that_long_after_it_was_opened,
    check_a_decision_after_the_expiry_is_refused_and_the_expiry_rejects_the_approval,
    check_a_late_decision_that_was_the_last_one_lets_the_run_continue,
    check_expire_approvals_decides_due_ones_only_oldest_first_and_continues_their_runs,
    check_an_expiry_keeps_a_refused_run_parked_until_resume,
    check_two_concurrent_expiry_passes_decide_each_approval_once,
    check_a_reconciliation_keeps_its_kind_and_question_and_is_answered_approved_or_rejected,
)
