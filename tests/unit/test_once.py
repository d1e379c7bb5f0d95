"""``@tool(once=True, reconcile=fn)`` on the memory runtime: a call its worker died in is reconciled, never re-run.

The crashes are the in-process ones of ``tests.fakes.crash``: a step stops dead at a named point, its lease left
to expire, as a SIGKILL would leave it. The real-worker version of these cases is ``tests/crash/test_once.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from store import errors, inputs
from store.memory import MemoryApprovalStore
from store.records import Checkpoint, Message
from tests.fakes.crash import Crashes, SimulatedCrash
from tests.fakes.runtime import TTL_MS, MemoryRuntime
from worker import Agent, ToolContext, tool
from worker.providers import MockModel
from worker.steps import Outcome

SID = "order-7"
CALL = "call_0_0"
CHARGE_TURN: list[Any] = [{"tool_calls": [{"name": "charge", "args": {"order": "7", "amount": 5}}]}, "Charged."]


class Payments:
    """A card processor: one charge per order, which ``charge_happened`` reads back."""

    def __init__(self) -> None:
        self.charges: dict[str, str] = {}
        #: (tool call id, ``ctx.attempt``) of every execution of ``charge``.
        self.executions: list[tuple[str, int]] = []
        #: (tool call id, ``ctx.attempt``) of every call of ``charge_happened``.
        self.reconciles: list[tuple[str, int]] = []
        #: Raised by ``charge_happened`` while set (the processor's API is down).
        self.reconcile_error: Exception | None = None
        #: Called inside ``charge`` right after the card was charged.
        self.after_effect: Callable[[ToolContext], None] | None = None

    def charge(self, order: str, amount: float, ctx: ToolContext) -> str:
        self.executions.append((ctx.tool_call_id, ctx.attempt))
        self.charges[order] = f"ch_{order}"
        if self.after_effect is not None:
            self.after_effect(ctx)
        return f"charged {amount} as ch_{order}"

    def charge_happened(self, args: dict[str, Any], ctx: ToolContext) -> str | None:
        self.reconciles.append((ctx.tool_call_id, ctx.attempt))
        if self.reconcile_error is not None:
            raise self.reconcile_error
        found = self.charges.get(args["order"])
        return None if found is None else f"charged {args['amount']} as {found}"


def _agent(payments: Payments, *, reconcile: bool = True, **tool_options: Any) -> Agent:
    def charge(order: str, amount: float, ctx: ToolContext) -> str:
        """Charge the card for an order."""
        return payments.charge(order, amount, ctx)

    options: dict[str, Any] = {"once": True, **tool_options}
    if reconcile:
        options["reconcile"] = payments.charge_happened
    return Agent("shop", MockModel(CHARGE_TURN), instructions="You run the shop.", tools=[tool(**options)(charge)])


def _result(checkpoint: Checkpoint, call_id: str = CALL) -> Message:
    (found,) = [m for m in checkpoint.messages if m.role == "tool" and m.tool_call_id == call_id]
    return found


def _reconcile_events(runtime: MemoryRuntime) -> list[dict[str, Any]]:
    return [e.data for e in runtime.store.read_events(SID, -1) if e.type == "tool.reconcile"]


def _crash_once_at(runtime: MemoryRuntime, point: str) -> None:
    """Send the charge, let the step that runs it die at ``point``, and let its lease expire."""
    runtime.send(SID, "shop", "Charge order 7")
    crashes = Crashes()
    with crashes.installed(runtime.leases):
        crashes.arm(point, SID)
        with pytest.raises(SimulatedCrash):
            runtime.drain()
        crashes.recovered()
    runtime.clock.advance(ms=TTL_MS + 1)
    runtime.queue(SID, None)  # what the recover sweep sends


# -- the definition ------------------------------------------------------------------------------


def test_reconcile_needs_once_and_a_function() -> None:
    def charge(order: str) -> str:
        """Charge."""
        return order

    with pytest.raises(errors.ConfigurationError, match="once=True"):
        tool(reconcile=lambda args, ctx: None)(charge)
    with pytest.raises(errors.ConfigurationError, match="callable"):
        tool(once=True, reconcile="charge_happened")(charge)  # type: ignore[call-overload]  # refused at definition
    assert tool(once=True)(charge).once and tool(charge).once is False


# -- the started mark ------------------------------------------------------------------------------


def test_a_once_call_is_marked_started_in_the_store_before_it_runs() -> None:
    payments = Payments()
    runtime = MemoryRuntime.build([_agent(payments)])
    seen: list[list[str]] = []
    payments.after_effect = lambda ctx: seen.append(runtime.checkpoint(SID).started_tool_call_ids)
    runtime.send(SID, "shop", "Charge order 7")
    assert runtime.drain()[-1] == Outcome.FINISHED
    assert seen == [[CALL]]
    final = runtime.checkpoint(SID)
    assert final.started_tool_call_ids == [] and payments.executions == [(CALL, 1)] and payments.reconciles == []
    assert _result(final).content == "charged 5.0 as ch_7"


# -- reconcile -------------------------------------------------------------------------------------


def test_a_once_call_killed_after_its_effect_is_reconciled_and_never_runs_again() -> None:
    payments = Payments()
    runtime = MemoryRuntime.build([_agent(payments)])
    _crash_once_at(runtime, "after_once_effect_before_result_save")
    assert runtime.drain()[-1] == Outcome.FINISHED
    # The card was charged once; reconcile found the charge and its answer is the call's result
    assert payments.executions == [(CALL, 1)] and payments.reconciles == [(CALL, 2)]
    assert _result(runtime.checkpoint(SID)).content == "charged 5.0 as ch_7"
    assert _reconcile_events(runtime) == [
        {"tool_call_id": CALL, "tool_name": "charge", "outcome": "happened", "by": "reconcile", "attempt": 2}
    ]


def test_a_once_call_killed_before_its_effect_runs_exactly_once_more() -> None:
    payments = Payments()
    runtime = MemoryRuntime.build([_agent(payments)])
    _crash_once_at(runtime, "after_started_marker_before_once_call")
    assert runtime.drain()[-1] == Outcome.FINISHED
    # reconcile saw no charge, so the call ran again: its only execution, as attempt 2
    assert payments.reconciles == [(CALL, 2)] and payments.executions == [(CALL, 2)]
    assert _result(runtime.checkpoint(SID)).content == "charged 5.0 as ch_7"
    assert [e["outcome"] for e in _reconcile_events(runtime)] == ["not-happened"]


def test_a_crash_before_the_started_mark_runs_the_call_as_a_first_attempt() -> None:
    payments = Payments()
    runtime = MemoryRuntime.build([_agent(payments)])
    _crash_once_at(runtime, "before_started_marker")
    assert runtime.drain()[-1] == Outcome.FINISHED
    assert payments.reconciles == [] and payments.executions == [(CALL, 2)]


def test_a_failing_reconcile_is_retried_then_a_person_is_asked_once_the_retry_budget_is_spent() -> None:
    payments = Payments()
    payments.reconcile_error = ConnectionError("processor unreachable")
    runtime = MemoryRuntime.build([_agent(payments)])
    runtime.deps.retry_for_s = 60.0
    _crash_once_at(runtime, "after_once_effect_before_result_save")
    outcomes = runtime.drain()
    # Given a reconcile that fails: the step is retried like any transient failure (short waits come back at once)
    assert set(outcomes) == {Outcome.FAILED}
    waiting = runtime.checkpoint(SID)
    assert waiting.last_error is not None and waiting.status == "in-progress"
    assert (waiting.last_error.code, waiting.last_error.retryable) == ("LOUSHO_RECONCILE_FAILED", True)
    assert "processor unreachable" in waiting.last_error.message
    # When it keeps failing past LOUSHO_RETRY_FOR_S
    for _ in range(40):
        runtime.clock.advance(seconds=31)
        runtime.sweep()
        outcomes += runtime.drain()
        if outcomes[-1] != Outcome.FAILED:
            break
    # Then the run waits for a person instead of being parked, and the call never ran again
    assert outcomes[-1] == Outcome.PAUSED and outcomes.count(Outcome.FAILED) >= 2
    (asked,) = MemoryApprovalStore(runtime.store).pending()
    assert asked.kind == "reconcile" and asked.tool_call_id == CALL and asked.expires_at is None
    assert asked.question is not None and "processor unreachable" in asked.question
    assert payments.executions == [(CALL, 1)]
    assert [e["outcome"] for e in _reconcile_events(runtime)][-1] == "asked"
    assert "failed" in [e["outcome"] for e in _reconcile_events(runtime)]


# -- a person decides --------------------------------------------------------------------------------


def _paused_on_reconcile(payments: Payments) -> tuple[MemoryRuntime, MemoryApprovalStore, str]:
    runtime = MemoryRuntime.build([_agent(payments, reconcile=False)])
    _crash_once_at(runtime, "after_once_effect_before_result_save")
    assert runtime.drain() == [Outcome.PAUSED]
    approvals = MemoryApprovalStore(runtime.store)
    (asked,) = approvals.pending()
    assert (asked.kind, asked.tool_name, asked.args) == ("reconcile", "charge", {"order": "7", "amount": 5})
    assert asked.question is not None and asked.expires_at is None
    paused = runtime.checkpoint(SID)
    assert paused.status == "awaiting-approval" and paused.approval_ids == [asked.approval_id]
    assert [e["outcome"] for e in _reconcile_events(runtime)] == ["asked"]
    return runtime, approvals, asked.approval_id


def test_without_reconcile_a_person_who_approves_runs_the_call_again() -> None:
    payments = Payments()
    runtime, approvals, approval_id = _paused_on_reconcile(payments)
    assert approvals.resolve(approval_id, approved=True).run_continues
    runtime.queue(SID, None)
    assert runtime.drain()[-1] == Outcome.FINISHED
    assert payments.executions == [(CALL, 1), (CALL, 2)]
    final = runtime.checkpoint(SID)
    assert _result(final).content == "charged 5.0 as ch_7" and final.approval_ids == []
    assert [(e["outcome"], e["by"]) for e in _reconcile_events(runtime)] == [
        ("asked", "reconcile"),
        ("not-happened", "person"),
    ]


def test_without_reconcile_a_person_who_rejects_records_the_call_as_not_done() -> None:
    payments = Payments()
    runtime, approvals, approval_id = _paused_on_reconcile(payments)
    approvals.resolve(approval_id, approved=False, note="refunded by hand")
    runtime.queue(SID, None)
    assert runtime.drain()[-1] == Outcome.FINISHED
    result = _result(runtime.checkpoint(SID))
    body = json.loads(result.content)
    assert result.is_error and (body["kind"], body["note"]) == ("not-done", "refunded by hand")
    assert payments.executions == [(CALL, 1)]
    assert _reconcile_events(runtime)[-1]["outcome"] == "not-done"


def test_without_reconcile_a_person_who_answers_records_the_answer_as_the_result() -> None:
    payments = Payments()
    runtime, approvals, approval_id = _paused_on_reconcile(payments)
    approvals.resolve(approval_id, answer="charged as ch_7 (checked on the dashboard)")
    runtime.queue(SID, None)
    assert runtime.drain()[-1] == Outcome.FINISHED
    result = _result(runtime.checkpoint(SID))
    assert not result.is_error and result.content == "charged as ch_7 (checked on the dashboard)"
    assert payments.executions == [(CALL, 1)]
    assert _reconcile_events(runtime)[-1] == {
        "tool_call_id": CALL,
        "tool_name": "charge",
        "outcome": "happened",
        "by": "person",
        "attempt": 2,
    }


def test_a_call_run_again_on_a_decision_and_killed_again_is_reconciled_again_not_run() -> None:
    payments = Payments()
    runtime, approvals, approval_id = _paused_on_reconcile(payments)
    approvals.resolve(approval_id, approved=True)
    runtime.queue(SID, None)
    crashes = Crashes()
    with crashes.installed(runtime.leases):
        crashes.arm("after_once_effect_before_result_save", SID)
        with pytest.raises(SimulatedCrash):
            runtime.drain()
        crashes.recovered()
    runtime.clock.advance(ms=TTL_MS + 1)
    runtime.queue(SID, None)
    # The decision was spent on the execution it allowed: a person is asked again
    assert runtime.drain() == [Outcome.PAUSED]
    (again,) = approvals.pending()
    assert again.approval_id != approval_id and again.kind == "reconcile"
    assert payments.executions == [(CALL, 1), (CALL, 2)]


@pytest.mark.parametrize(
    ("approved", "answer", "decided"),
    [
        (True, None, ("approved", None)),
        (False, None, ("rejected", None)),
        (None, "ch_7", ("approved", "ch_7")),
        (True, "ch_7", ("approved", "ch_7")),
    ],
)
def test_a_reconcile_decision_runs_again_records_not_done_or_records_an_answer(
    approved: bool | None, answer: str | None, decided: tuple[str, str | None]
) -> None:
    assert inputs.decision_status("reconcile", approved, answer) == decided


def test_a_reconcile_decision_that_says_not_done_and_answers_is_refused() -> None:
    with pytest.raises(errors.ConfigurationError):
        inputs.decision_status("reconcile", False, "ch_7")
    with pytest.raises(errors.ConfigurationError):
        inputs.decision_status("reconcile", None, None)


# -- approved calls and plain calls ------------------------------------------------------------------


def test_an_approved_once_call_killed_mid_call_is_interrupted_and_not_reconciled() -> None:
    payments = Payments()
    runtime = MemoryRuntime.build([_agent(payments, needs_approval=True)])
    runtime.send(SID, "shop", "Charge order 7")
    assert runtime.drain() == [Outcome.ADVANCED, Outcome.PAUSED]
    approvals = MemoryApprovalStore(runtime.store)
    (gate,) = approvals.pending()
    assert gate.kind == "tool"
    approvals.resolve(gate.approval_id, approved=True)
    runtime.queue(SID, None)
    crashes = Crashes()
    with crashes.installed(runtime.leases):
        crashes.arm("after_approved_effect_before_result_save", SID)
        with pytest.raises(SimulatedCrash):
            runtime.drain()
        crashes.recovered()
    runtime.clock.advance(ms=TTL_MS + 1)
    runtime.queue(SID, None)
    assert runtime.drain()[-1] == Outcome.FINISHED
    assert json.loads(_result(runtime.checkpoint(SID)).content)["kind"] == "interrupted"
    assert payments.executions == [(CALL, 1)] and payments.reconciles == []


def test_tool_context_attempt_counts_a_start_that_a_crash_cut_short() -> None:
    # Given two calls run one after the other, the second killed mid-call on its first execution
    attempts: list[tuple[str, int]] = []
    crashes = Crashes()

    @tool
    def reserve(sku: str, ctx: ToolContext) -> str:
        """Reserve stock."""
        attempts.append((sku, ctx.attempt))
        if sku == "B2":
            crashes.crash_point("inside_reserve", ctx.session_id)
        return f"reserved {sku}"

    script: list[Any] = [
        {"tool_calls": [{"name": "reserve", "args": {"sku": "A1"}}, {"name": "reserve", "args": {"sku": "B2"}}]},
        "Reserved.",
    ]
    runtime = MemoryRuntime.build([Agent("shop", MockModel(script), tools=[reserve], tool_concurrency=1)])
    runtime.send(SID, "shop", "Reserve both")
    with crashes.installed(runtime.leases):
        crashes.arm("inside_reserve", SID)
        with pytest.raises(SimulatedCrash):
            runtime.drain()
        crashes.recovered()
    runtime.clock.advance(ms=TTL_MS + 1)
    runtime.queue(SID, None)
    assert runtime.drain()[-1] == Outcome.FINISHED
    # Then the first ran once as attempt 1, the second ran again as attempt 2
    assert attempts == [("A1", 1), ("B2", 1), ("B2", 2)]


def test_tool_context_attempt_counts_every_start_that_died_before_a_save() -> None:
    attempts: list[int] = []
    crashes = Crashes()

    @tool
    def reserve(sku: str, ctx: ToolContext) -> str:
        """Reserve stock."""
        attempts.append(ctx.attempt)
        crashes.crash_point("inside_reserve", ctx.session_id)
        return f"reserved {sku}"

    script: list[Any] = [{"tool_calls": [{"name": "reserve", "args": {"sku": "A1"}}]}, "Reserved."]
    runtime = MemoryRuntime.build([Agent("shop", MockModel(script), tools=[reserve])])
    runtime.send(SID, "shop", "Reserve")
    with crashes.installed(runtime.leases):
        for _ in range(2):
            crashes.arm("inside_reserve", SID)
            with pytest.raises(SimulatedCrash):
                runtime.drain()
            crashes.recovered()
            runtime.clock.advance(ms=TTL_MS + 1)
            runtime.queue(SID, None)
        assert runtime.drain()[-1] == Outcome.FINISHED
    assert attempts == [1, 2, 3]


def test_once_calls_run_beside_other_calls_of_a_parallel_batch() -> None:
    payments = Payments()
    ran: list[str] = []

    @tool
    def reserve(sku: str) -> str:
        """Reserve stock."""
        ran.append(sku)
        return f"reserved {sku}"

    def charge(order: str, amount: float, ctx: ToolContext) -> str:
        """Charge the card for an order."""
        return payments.charge(order, amount, ctx)

    script: list[Any] = [
        {
            "tool_calls": [
                {"name": "reserve", "args": {"sku": "A1"}},
                {"name": "charge", "args": {"order": "7", "amount": 5}},
                {"name": "charge", "args": {"order": "8", "amount": 6}},
                {"name": "reserve", "args": {"sku": "B2"}},
            ]
        },
        "Done.",
    ]
    agent = Agent("shop", MockModel(script), tools=[reserve, tool(once=True)(charge)], tool_concurrency=4)
    runtime = MemoryRuntime.build([agent])
    runtime.send(SID, "shop", "Charge both and reserve")
    assert runtime.drain()[-1] == Outcome.FINISHED
    final = runtime.checkpoint(SID)
    assert sorted(ran) == ["A1", "B2"] and sorted(payments.charges) == ["7", "8"]
    assert [m.tool_call_id for m in final.messages if m.role == "tool"] == [f"call_0_{k}" for k in range(4)]
    assert final.started_tool_call_ids == []


def test_an_abort_of_a_run_waiting_on_a_reconciliation_withdraws_it_and_cancels_the_call() -> None:
    payments = Payments()
    runtime, approvals, approval_id = _paused_on_reconcile(payments)
    runtime.store.request_abort(SID)
    runtime.queue(SID, None)
    assert runtime.drain() == [Outcome.ABORTED]
    stopped = runtime.checkpoint(SID)
    assert (stopped.finish_reason, stopped.started_tool_call_ids, stopped.approval_ids) == ("aborted", [], [])
    assert json.loads(_result(stopped).content)["kind"] == "cancelled"
    assert approvals.by_ids([approval_id])[approval_id].status == "withdrawn"
    assert payments.executions == [(CALL, 1)]
