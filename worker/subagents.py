"""Sub-agents as child runs: what a lead's ``task`` call starts, and the result it gets once the child settles.

A ``task`` call never runs in the lead's step. The step creates the child run (``<lead>.task-<16 hex>``, derived
from the lead, its step and the call, so a step that runs again finds the same child), saves that the call is
delegated and that the lead waits, and ends; each child is a run of its own, its steps tasks on any worker. A
child that finishes, parks or stops wakes its lead (and the recovery sweep wakes a lead whose wake-up was lost);
the lead's next step records each settled child's final text as its call's result, with the child's usage.
"""

from __future__ import annotations

import hashlib

from store import records
from store.records import Checkpoint, EventDraft, Message, ToolCall, Usage
from worker import machine

__all__ = ["child_id", "done", "result_of", "started"]

#: Longest run id (``store.records.validate_session_id``).
_MAX_ID = 200


def child_id(lead: str, step: int, call_id: str) -> str | None:
    """The id of the child run a lead's ``task`` call starts (None when the lead's id leaves no room for it)."""
    digest = hashlib.sha256(f"{lead}\n{step}\n{call_id}".encode()).hexdigest()[:16]
    child = f"{lead}{records.CHILD_MARK}{digest}"
    return child if len(child) <= _MAX_ID else None


def _footer(name: str, child: Checkpoint) -> str:
    return (f"\n\n[sub-agent '{name}': {child.step} step(s), finish reason '{child.finish_reason}',"
            f" task '{child.session_id}']")


def result_of(call: ToolCall, child: Checkpoint | None) -> Message | None:
    """The delegated call's result from its child's state, or None while the child can still move on its own.

    A child that finished with ``stop`` or ``length`` gives its final text; any other end (parked, stopped, another
    finish reason, deleted) gives an error result the lead's model can read.
    """
    name = str(call.args.get("agent", ""))
    if child is None:
        return machine.tool_error(call, "execution", "SubagentGone", "the sub-agent's run was deleted")
    if child.status == "finished":
        if child.finish_reason in ("stop", "length"):
            return machine.tool_message(call, (child.final_text or "") + _footer(name, child))
        return machine.tool_error(call, "execution", "SubagentUnfinished",
                                  f"the sub-agent ended with '{child.finish_reason}'" + _footer(name, child))
    if child.last_error is not None and not child.last_error.retryable:
        return machine.tool_error(call, "execution", "SubagentParked",
                                  f"the sub-agent stopped on an error {child.last_error.code}:"
                                  f" {child.last_error.message}" + _footer(name, child))
    if child.aborted:
        return machine.tool_error(call, "execution", "SubagentStopped",
                                  f"the sub-agent was stopped ('{child.finish_reason}')" + _footer(name, child))
    return None


def usage_of(child: Checkpoint | None) -> Usage:
    """What the child spent (folded into its lead's usage with the call's result)."""
    return child.usage if child is not None else Usage()


def started(call: ToolCall, child: str) -> EventDraft:
    """The lead delegated ``call`` to the child run ``child``."""
    return EventDraft(type="subagent.start", data={
        "tool_call_id": call.id, "agent": call.args.get("agent"), "child_run_id": child,
        "description": call.args.get("description") or ""})


def done(call: ToolCall, child: str, state: Checkpoint | None) -> EventDraft:
    """The child of ``call`` settled and its result was recorded."""
    return EventDraft(type="subagent.done", data={
        "tool_call_id": call.id, "agent": call.args.get("agent"), "child_run_id": child,
        "finish_reason": state.finish_reason if state is not None else None,
        "steps": state.step if state is not None else 0, "usage": usage_of(state).model_dump()})
