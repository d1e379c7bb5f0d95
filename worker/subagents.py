"""Sub-agents as child runs: what a lead's ``task`` call starts, and the result it gets once the child settles.

A ``task`` call never runs in the lead's step. The step creates the child run (``<lead>.task-<16 hex>``, derived
from the lead, its step and the call, so a step that runs again finds the same child), saves that the call is
delegated and that the lead waits, and ends; each child is a run of its own, its steps tasks on any worker. A
child that finishes, parks or stops wakes its lead (and the recovery sweep wakes a lead whose wake-up was lost);
the lead's next step records each settled child's final text as its call's result, with the child's usage.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from store import records
from store.interfaces import StepStore
from store.records import Checkpoint, EventDraft, Message, ToolCall, Usage
from worker import machine
from worker.agents import Agent

__all__ = ["child_id", "done", "result_of", "started"]

#: Longest run id (``store.records.validate_session_id``).
_MAX_ID = 200


def child_id(lead: str, step: int, call_id: str) -> str | None:
    """The id of the child run a lead's ``task`` call starts (None when the lead's id leaves no room for it)."""
    digest = hashlib.sha256(f"{lead}\n{step}\n{call_id}".encode()).hexdigest()[:16]
    child = f"{lead}{records.CHILD_MARK}{digest}"
    return child if len(child) <= _MAX_ID else None


def _footer(name: str, child: Checkpoint) -> str:
    return (
        f"\n\n[sub-agent '{name}': {child.step} step(s), finish reason '{child.finish_reason}',"
        f" task '{child.session_id}']"
    )


def state_of(child: Checkpoint | None) -> str:
    """Where a child stands: ``gone``, ``finished``, ``stopped`` (an abort or a budget), or its run state.

    A run state is ``awaiting-approval``, ``parked``, ``retrying`` or ``running`` (``records.run_state``; a child
    waiting on its own children is ``running`` here: it still moves by itself).
    """
    if child is None:
        return "gone"
    if child.status == "finished":
        return "finished"
    if child.aborted:
        return "stopped"
    return records.run_state(child.status, child.last_error, child.next_attempt_at)


def result_of(call: ToolCall, child: Checkpoint | None) -> Message | None:
    """The delegated call's result from its child's state, or None while the child can still move on its own.

    A child that finished with ``stop`` or ``length`` gives its final text; any other end (parked, stopped, another
    finish reason, deleted) gives an error result the lead's model can read. A child refused to resume (its agent
    changed under it: ``records.REFUSAL_CODES``) gives none: the lead waits until a person puts the agent back and
    resumes the child, as it waits on a child's approval, rather than moving on without the child's work.
    """
    name, state = str(call.args.get("agent", "")), state_of(child)
    if child is None:
        return machine.tool_error(call, "execution", "SubagentGone", "the sub-agent's run was deleted")
    if state == "finished":
        if child.finish_reason in ("stop", "length"):
            return machine.tool_message(call, (child.final_text or "") + _footer(name, child))
        return machine.tool_error(
            call,
            "execution",
            "SubagentUnfinished",
            f"the sub-agent ended with '{child.finish_reason}'" + _footer(name, child),
        )
    if state == "parked" and records.is_refused(child.last_error):
        return None
    if state == "parked" and child.last_error is not None:
        return machine.tool_error(
            call,
            "execution",
            "SubagentParked",
            f"the sub-agent stopped on an error {child.last_error.code}:"
            f" {child.last_error.message}" + _footer(name, child),
        )
    if state == "stopped":
        return machine.tool_error(
            call,
            "execution",
            "SubagentStopped",
            f"the sub-agent was stopped ('{child.finish_reason}')" + _footer(name, child),
        )
    return None


_inheriting: dict[tuple[int, int], Agent] = {}


def inheriting(agent: Agent, checkpoint: Checkpoint, agents: Mapping[str, Agent]) -> Agent:
    """The agent a child run's step runs as: its own, with its lead's hooks first and the lead's drift policy.

    Each level's drift is checked against its own saved agent, under the policy of the run on top.
    """
    lead = agents.get(checkpoint.lead_agent) if checkpoint.lead_agent else None
    if lead is None or (not lead.hooks and lead.on_agent_drift == agent.on_agent_drift):
        return agent
    key = (id(agent), id(lead))
    known = _inheriting.get(key)
    if known is None:
        known = agent.replace(hooks=(*lead.hooks, *agent.hooks), on_agent_drift=lead.on_agent_drift)
        _inheriting[key] = known
    return known


def status_of(task_id: str, child: Checkpoint | None) -> dict[str, object]:
    """What ``agent_status`` tells the model about a background task."""
    state = state_of(child)
    if child is None:
        return {"task_id": task_id, "status": state}
    body: dict[str, object] = {"task_id": task_id, "agent": child.agent, "steps": child.step}
    if state == "finished":
        body.update(status="finished", finish_reason=child.finish_reason, result=child.final_text)
    elif state == "awaiting-approval":
        body.update(status="awaiting-approval", waiting_on="a person's decision")
    elif state == "parked" and child.last_error is not None:
        body.update(status="failed", error=child.last_error.code)
    elif state == "stopped":
        body.update(
            status="cancelled" if child.finish_reason == "aborted" else "stopped", finish_reason=child.finish_reason
        )
    else:
        body.update(status="running")  # running, or retrying after a transient failure
    return body


def running(children: list[Checkpoint | None]) -> list[str]:
    """The ids of the children that can still move on their own (not settled, not paused)."""
    return [c.session_id for c in children if c is not None and state_of(c) in ("running", "retrying")]


def in_flight(store: StepStore, checkpoint: Checkpoint) -> Usage:
    """What the run's background tasks still running spent so far (the lead's limits count it meanwhile)."""
    total = Usage()
    for child in checkpoint.background or ():
        state = store.load(child)
        if state is not None and state_of(state) in ("running", "retrying"):
            total = total + state.usage
    return total


def usage_of(child: Checkpoint | None) -> Usage:
    """What the child spent (folded into its lead's usage with the call's result)."""
    return child.usage if child is not None else Usage()


def started(call: ToolCall, child: str) -> EventDraft:
    """The lead delegated ``call`` to the child run ``child``."""
    return EventDraft(
        type="subagent.start",
        data={
            "tool_call_id": call.id,
            "agent": call.args.get("agent"),
            "child_run_id": child,
            "description": call.args.get("description") or "",
        },
    )


def done(call: ToolCall, child: str, state: Checkpoint | None) -> EventDraft:
    """The child of ``call`` settled and its result was recorded."""
    return EventDraft(
        type="subagent.done",
        data={
            "tool_call_id": call.id,
            "agent": call.args.get("agent"),
            "child_run_id": child,
            "finish_reason": state.finish_reason if state is not None else None,
            "steps": state.step if state is not None else 0,
            "usage": usage_of(state).model_dump(),
        },
    )
