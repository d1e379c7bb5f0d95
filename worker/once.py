"""Tools whose effect must not happen twice: what becomes of a call found marked started without a result.

A ``once`` call (``@tool(once=True)``) is marked started by a fenced save before it runs, as an approved call is
(``worker.batch``). A later step that finds the mark and no result does not run the call again blindly: the tool's
``reconcile`` says whether its effect happened (its answer is the call's result) or not (the call runs again);
without ``reconcile``, or while it keeps failing past the retry budget, a person decides on an approval of kind
``reconcile``. Approved calls keep their own rule (RELIABILITY I5): interrupted, they get an ``interrupted`` result.
Framework-free, and it writes nothing: the batch saves what these verdicts say, with their events.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Literal

from store import errors, payloads, telemetry
from store.records import Approval, EventDraft, Message, ToolCall
from worker import live, machine
from worker.agents import Agent, ToolContext

#: ``by`` of a reconciliation's event: the tool's ``reconcile`` (or its absence), or a person's decision.
BY_RECONCILE, BY_PERSON = "reconcile", "person"


@dataclass(frozen=True)
class Settled:
    """The call gets ``result`` without running (written with ``events``)."""

    result: Message
    events: tuple[EventDraft, ...] = ()


@dataclass(frozen=True)
class Rerun:
    """The call runs again: its effect did not happen. ``consumes``: the decision this execution spends."""

    call: ToolCall
    consumes: str | None
    events: tuple[EventDraft, ...]


@dataclass(frozen=True)
class Ask:
    """A person decides: the run waits on an approval of kind ``reconcile`` saying ``reason``."""

    call: ToolCall
    reason: str
    events: tuple[EventDraft, ...]


@dataclass(frozen=True)
class Failed:
    """``reconcile`` raised within the retry budget: the step fails as a transient failure and is retried."""

    error: errors.ReconcileFailedError
    events: tuple[EventDraft, ...]


#: ``after_crash``: call ``reconcile`` (or ask a person when the tool has none).
RECONCILE: Final = "reconcile"
#: ``after_crash``: a person has not decided yet.
UNDECIDED: Final = "undecided"


def _noted(call: ToolCall, outcome: str, by: str, attempt: int, code: str | None = None) -> tuple[EventDraft, ...]:
    """The ``tool.reconcile`` event of an outcome, counted for the metrics as it is drafted."""
    telemetry.reconciled(call.name, outcome)
    return (live.tool_reconcile(call, outcome, by, attempt, code),)


def after_crash(
    agent: Agent, call: ToolCall, decision: Approval | None, attempt: int
) -> Settled | Rerun | Literal["reconcile", "undecided"]:
    """What becomes of ``call``, marked started and without a result; ``decision`` is its approval, if any.

    A reconciliation a person decided: run again (approved), not done (rejected) or the answer as the result. A
    call a person approved (a gated call), or one whose tool is not ``once`` (any more): ``interrupted``. Else the
    call is reconciled.
    """
    if decision is not None and decision.kind == "reconcile":
        if decision.status == "pending":
            return UNDECIDED
        if decision.status == "approved" and decision.answer is not None:
            return Settled(machine.tool_message(call, decision.answer), _noted(call, "happened", BY_PERSON, attempt))
        if decision.status == "approved":
            return Rerun(call, decision.approval_id, _noted(call, "not-happened", BY_PERSON, attempt))
        if decision.status == "rejected":
            return Settled(machine.not_done(call, decision.note), _noted(call, "not-done", BY_PERSON, attempt))
        return RECONCILE  # withdrawn: asked anew
    tool = agent.tools.get(call.name)
    if (decision is not None and decision.status == "approved") or tool is None or not tool.once:
        return Settled(machine.interrupted(call))
    return RECONCILE


def reconcile(
    agent: Agent, call: ToolCall, context: ToolContext, retry_spent: Callable[[], float | None]
) -> Settled | Rerun | Ask | Failed:
    """Ask the tool's ``reconcile`` what became of ``call``; a person is asked when there is none.

    ``retry_spent()`` is None while the run's retry budget lasts, else the seconds it has been retried: a
    ``reconcile`` that raises is then no longer retried, a person is asked instead.
    """
    tool = agent.tools[call.name]
    attempt = context.attempt
    if tool.reconcile is None:
        return Ask(
            call,
            f"The {call.name} call was running when its worker died, and the tool has no reconcile"
            " function. Did it take effect? " + _CHOICES,
            _noted(call, "asked", BY_RECONCILE, attempt),
        )
    try:
        found = tool.reconciled(call.args, context)
    except Exception as exc:  # a raising reconcile is a transient failure of the step, never the call's result
        cause = payloads.clean_error(f"{type(exc).__name__}: {str(exc)[:500]}")
        error = errors.ReconcileFailedError(
            f"reconcile of the {call.name} call {call.id} raised {cause}", tool_call_id=call.id
        )
        spent = retry_spent()
        failed = _noted(call, "failed", BY_RECONCILE, attempt, error.code)
        if spent is None:
            return Failed(error, failed)
        return Ask(
            call,
            f"The {call.name} call was running when its worker died, and its reconcile function kept"
            f" failing for {spent:.0f} s (last: {cause}). Did it take effect? " + _CHOICES,
            failed + _noted(call, "asked", BY_RECONCILE, attempt),
        )
    if found is None:
        return Rerun(call, None, _noted(call, "not-happened", BY_RECONCILE, attempt))
    return Settled(machine.tool_message(call, found), _noted(call, "happened", BY_RECONCILE, attempt))


_CHOICES = (
    "Approve to run it again, reject to record it as not done, or answer with its result to record that"
    " as the call's result."
)
