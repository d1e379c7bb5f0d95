"""Approvals and questions that expire: undecided past ``expires_in`` they count as rejected (declined), the
recovery sweep decides them so and sends the run on, and a late decision is refused with its own error."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, text

from producer.client import Client
from store import errors
from store.approvals import EXPIRED_NOTE, PostgresApprovalStore
from store.checkpoints import PostgresCheckpointStore
from store.records import Approval, Message
from tests.support.driver import Driver, Sent, paused_row
from worker import Agent, tasks, tool
from worker.providers import MockModel

AGENT = "expiring"
#: The tool's own expiry wins over the agent's, which the question gets. Both are past a lease TTL (2 s in
#: the tests), so the sweep pass that rejects them also finds the run stale and sends it.
TOOL_EXPIRES_S = 2.2
QUESTION_EXPIRES_S = 2.5
ROUNDS = 60

refunded: list[int] = []


@tool(needs_approval=True, expires_in=TOOL_EXPIRES_S)
def refund(amount: int) -> str:
    """Refund money."""
    refunded.append(amount)
    return f"refunded {amount}"


def _agent(seen: list[dict[str, Any]]) -> Agent:
    """One turn asks for a gated refund and a question; the next records the results it was shown."""

    def model(messages: list[Message]) -> Any:
        if not any(m.role == "assistant" for m in messages):
            return {
                "tool_calls": [
                    {"name": "refund", "args": {"amount": 5}},
                    {"name": "ask_question", "args": {"question": "Which account?"}},
                ]
            }
        seen.append({str(m.name): json.loads(str(m.content)) for m in messages if m.role == "tool"})
        return "handled"

    return Agent(
        name=AGENT, model=MockModel(model), tools=[refund], ask_question=True, approval_expires_in=QUESTION_EXPIRES_S
    )


def _paused(make_driver: Callable[..., Driver], client: Client, session_id: str, seen: list[dict[str, Any]]) -> Driver:
    refunded.clear()
    driver = make_driver(_agent(seen))
    client.agent(AGENT).send("refund order 7", session_id=session_id)
    driver.drain(session_id)
    checkpoint = client.store.load(session_id)
    assert checkpoint is not None and checkpoint.status == "awaiting-approval"
    return driver


def _wait_past(engine: Engine, seconds_after_pause: float, session_id: str) -> None:
    """Sleep until Postgres's clock is ``seconds_after_pause`` past the run's pausing save."""
    with engine.begin() as conn:
        left = conn.execute(
            text(
                "SELECT extract(epoch FROM updated_at + make_interval(secs => :s) - now())"
                " FROM runs WHERE session_id = :sid"
            ),
            {"s": seconds_after_pause, "sid": session_id},
        ).scalar_one()
    time.sleep(max(0.0, float(left)) + 0.05)


def _note_of(approval: Approval) -> str:
    """The note an expiry gives ``approval``."""
    assert approval.expires_at is not None
    return EXPIRED_NOTE + approval.expires_at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f+00:00")


def test_undecided_approvals_expire_and_the_sweep_sends_the_run_on(
    make_driver: Callable[..., Driver], client: Client, sent: Sent, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[dict[str, Any]] = []
    driver = _paused(make_driver, client, "exp-1", seen)
    listed = {a.tool_name: a for a in client.agent(AGENT).approvals.list()}
    for name, seconds in (("refund", TOOL_EXPIRES_S), ("ask_question", QUESTION_EXPIRES_S)):
        created, expires = listed[name].created_at, listed[name].expires_at
        assert created is not None and expires == created + timedelta(seconds=seconds)
    assert tasks.recover() == 0 and sent.messages == []  # not due yet: nothing expires, nothing is sent

    _wait_past(client.engine, QUESTION_EXPIRES_S, "exp-1")
    with caplog.at_level(logging.INFO, logger=tasks.log.name):
        assert tasks.recover() == 1
    assert [m[0] for m in sent.messages] == ["exp-1"]  # in the same pass that expired its approvals
    assert "recover: 2 approval(s) expired undecided" in caplog.messages
    assert client.agent(AGENT).approvals.list() == []
    driver.drain("exp-1")

    checkpoint = client.store.load("exp-1")
    assert checkpoint is not None and (checkpoint.status, checkpoint.final_text) == ("finished", "handled")
    results = seen[-1]
    assert (results["refund"]["kind"], results["ask_question"]["kind"]) == ("rejected", "declined")
    assert results["refund"]["note"] == _note_of(listed["refund"])
    assert results["ask_question"]["note"] == _note_of(listed["ask_question"])
    assert refunded == []  # the expired call never ran


def test_a_late_decision_is_refused_and_the_run_goes_on_as_rejected(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    seen: list[dict[str, Any]] = []
    driver = _paused(make_driver, client, "exp-2", seen)
    approvals = client.agent(AGENT).approvals
    listed = {a.tool_name: a.approval_id for a in approvals.list()}
    answered = approvals.resolve(listed["ask_question"], answer="savings")  # in time
    assert answered.session_id == "exp-2"

    _wait_past(client.engine, TOOL_EXPIRES_S, "exp-2")
    with pytest.raises(errors.ApprovalExpiredError) as late:
        approvals.resolve(listed["refund"], approved=True, note="go ahead")
    assert late.value.code == "LOUSHO_APPROVAL_EXPIRED" and isinstance(late.value, errors.ApprovalNotFoundError)
    decided = PostgresApprovalStore(client.engine).by_ids([listed["refund"]])[listed["refund"]]
    assert decided.status == "rejected" and decided.note is not None and decided.note.startswith(EXPIRED_NOTE)
    checkpoint = client.store.load("exp-2")
    assert checkpoint is not None and checkpoint.status == "in-progress"  # the expiry was the last decision
    driver.drain("exp-2")

    results = seen[-1]
    assert results["refund"]["kind"] == "rejected" and results["refund"]["note"] == decided.note
    assert results["ask_question"] == {"answer": "savings"}
    assert refunded == []


def test_the_sweep_racing_a_decision_and_a_delete_never_deadlocks_and_decides_once(
    store: PostgresCheckpointStore,
) -> None:
    approvals = PostgresApprovalStore(store.engine)
    storage_errors: list[str] = []
    swept = 0
    lock = threading.Lock()

    def sweep(start: threading.Barrier) -> None:
        nonlocal swept
        start.wait()
        try:
            count = store.expire_approvals()
        except errors.StorageError as exc:
            storage_errors.append(exc.message)
            return
        with lock:
            swept += count

    def resolve(approval_id: str, start: threading.Barrier) -> None:
        start.wait()
        try:
            approvals.resolve(approval_id, approved=True)
        except (errors.ApprovalExpiredError, errors.ApprovalOrphanedError, errors.ApprovalNotFoundError):
            pass
        except errors.StorageError as exc:
            storage_errors.append(exc.message)

    def delete(session_id: str, start: threading.Barrier) -> None:
        start.wait()
        try:
            store.delete(session_id)
        except errors.StorageError as exc:
            storage_errors.append(exc.message)

    for k in range(ROUNDS):
        session_id, approval_id = paused_row(store, f"exp-race-{k}", expired=True)
        start = threading.Barrier(3)
        racers = [
            threading.Thread(target=sweep, args=(start,)),
            threading.Thread(target=resolve, args=(approval_id, start)),
        ]
        racers.append(
            threading.Thread(target=delete, args=(session_id, start))
            if k % 2
            else threading.Thread(target=sweep, args=(start,))
        )
        for thread in racers:
            thread.start()
        for thread in racers:
            thread.join(timeout=30)
    with store.engine.begin() as conn:
        rows = conn.execute(text("SELECT status, count(*) FROM approvals GROUP BY status")).all()
    statuses: dict[str, int] = {row[0]: row[1] for row in rows}
    print(
        f"\n[expiry races] {ROUNDS} rounds: sweeps decided {swept}, final statuses {statuses},"
        f" storage errors {sorted(set(storage_errors))}"
    )
    assert storage_errors == []
    assert set(statuses) <= {"rejected", "withdrawn"} and sum(statuses.values()) == ROUNDS
    assert swept <= ROUNDS  # never two decisions of one approval
