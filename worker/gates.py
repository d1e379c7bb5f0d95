"""Which calls of a tool batch run now: argument checks, ``pre_tool_call`` hooks, approval rules and decisions.

Each pending call is sorted (``sort_calls``) into what runs, what waits for a person (with the approvals asked
for), what hands off or delegates, and what is settled without running. Nothing here runs a tool or saves.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from store import errors, payloads
from store.records import Approval, Checkpoint, EventDraft, Message, ToolCall
from worker import business, handoffs, machine, once
from worker import hooks as hook_calls
from worker.agents import (
    ASK_QUESTION,
    SUBAGENT_TOOLS,
    Agent,
    ToolArgsInvalid,
    ToolContext,
)
from worker.context import StepDeps
from worker.hooks import Deny, HookContext, Input
from worker.hooks import Result as HookResult


@dataclass
class Plan:
    """Each pending call sorted by what happens to it now."""

    results: list[Message] = field(default_factory=list)  # settled without running
    notes: dict[str, tuple[EventDraft, ...]] = field(default_factory=dict)  # events saved with a settled result
    run: list[ToolCall] = field(default_factory=list)  # cleared to run now (once calls run again too)
    approved: list[ToolCall] = field(default_factory=list)  # decided yes: started marker first
    gated: list[ToolCall] = field(default_factory=list)  # waits for a human decision
    handoffs: list[ToolCall] = field(default_factory=list)  # transfer_to_<name>: recorded, never run
    tasks: list[ToolCall] = field(default_factory=list)  # task: a child run gives the result
    undecided: list[str] = field(default_factory=list)  # approvals of calls still waiting for a person
    approval_of: dict[str, str] = field(default_factory=dict)  # approved call id -> the approval that let it run
    reconcile: list[ToolCall] = field(default_factory=list)  # once calls found started without a result
    reruns: dict[str, once.Rerun] = field(default_factory=dict)  # once calls found not done: they run again
    asks: list[once.Ask] = field(default_factory=list)  # once calls a person reconciles
    decided: dict[str, str] = field(default_factory=dict)  # approval id -> call id of the turn's decisions
    writes: dict[str, business.Write] = field(default_factory=dict)  # call id -> its pre_tool_call hooks' write

    def settled(self, outcome: once.Settled, call: ToolCall) -> None:
        """Record a verdict's result and its events."""
        self.results.append(outcome.result)
        if outcome.events:
            self.notes[call.id] = outcome.events

    def take_decision(self, outcome: Message | ToolCall | None, decision: Approval) -> bool:
        """Record a decided call: its result (rejected, or settled by the decision) or approved to run; False if not."""
        if outcome is None:
            return False
        if isinstance(outcome, Message):
            self.results.append(outcome)
        else:
            self.approved.append(outcome)
            self.approval_of[outcome.id] = decision.approval_id
        return True

    def rerun(self, outcome: once.Rerun, order: list[str]) -> None:
        """Run a once call again, in call order among the calls cleared to run."""
        self.reruns[outcome.call.id] = outcome
        self.run.append(outcome.call)
        self.run.sort(key=lambda c: order.index(c.id))


def call_context(
    agent: Agent,
    checkpoint: Checkpoint,
    call: ToolCall,
    cancelled: threading.Event | None = None,
    attempt: int = 1,
    approval_id: str | None = None,
    state: Any = None,
) -> ToolContext:
    """The context of a call that runs, starting from business state ``state`` (a copy of it)."""
    return ToolContext(
        tool_call_id=call.id,
        session_id=checkpoint.session_id,
        agent=agent.name,
        step=checkpoint.step,
        business_state=business.handed(state),
        checkpoint_seq=checkpoint.seq,
        cancelled=cancelled or threading.Event(),
        attempt=attempt,
        approval_id=approval_id,
    )


def reading_context(
    agent: Agent, checkpoint: Checkpoint, call: ToolCall, cancelled: threading.Event | None = None, attempt: int = 1
) -> ToolContext:
    """The context of a function that only reads (an approval rule, ``reconcile``): it cannot write the state."""
    return business.read_only(
        call_context(agent, checkpoint, call, cancelled, attempt, state=checkpoint.business_state)
    )


def hook_context(
    agent: Agent, checkpoint: Checkpoint, call: ToolCall, resumed: bool = False, state: Any = None
) -> HookContext:
    """What the ``pre_tool_call`` and ``post_tool_call`` hooks of a call see."""
    return HookContext(
        session_id=checkpoint.session_id,
        agent=agent.name,
        step=checkpoint.step,
        metadata=checkpoint.metadata,
        tool_call_id=call.id,
        tool_name=call.name,
        args=dict(call.args),
        resumed_after_approval=resumed,
        business_state=business.handed(state),
    )


def _same_args(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two argument objects are equal as JSON (key order aside)."""
    return json.dumps(payloads.sanitize(a), sort_keys=True) == json.dumps(payloads.sanitize(b), sort_keys=True)


def gate(
    agent: Agent, checkpoint: Checkpoint, call: ToolCall, writes: dict[str, business.Write], pinned: bool = False
) -> ToolCall | Message:
    """The call as the ``pre_tool_call`` hooks leave it, or the result they settle it with.

    ``pinned``: a person approved ``call.args``; a hook that changes them gets the call a validation error.
    A business state the hooks wrote goes in ``writes`` (saved with the call's result).

    Raises:
        HookFailedError: a hook raised, or wrote a business state that cannot be saved.
    """
    hooks = hook_calls.having(agent.hooks, "pre_tool_call")
    if not hooks:
        return call
    ctx = hook_context(agent, checkpoint, call, resumed=pinned, state=checkpoint.business_state)
    verdict = hook_calls.pre_tool_call(hooks, ctx)
    write = business.hook_written(checkpoint.business_state, ctx)
    if write is not None:
        writes[call.id] = write
    if isinstance(verdict, Deny):
        return machine.tool_error(call, "denied", "ToolDenied", verdict.reason or "a hook denied this call")
    if isinstance(verdict, HookResult):
        return machine.tool_message(call, verdict.value, replaced_by_hook=True)
    if isinstance(verdict, Input):
        if pinned:
            if not _same_args(verdict.args, call.args):
                return machine.tool_error(
                    call,
                    "validation",
                    "ApprovedArgsChanged",
                    "a hook tried to change the arguments a person approved; the call did not run",
                )
            return call
        try:
            agent.tools[call.name].validate(verdict.args)
        except ToolArgsInvalid as exc:
            return machine.tool_error(call, "validation", "ToolArgsInvalid", f"arguments from a hook: {exc}")
        return call.model_copy(update={"args": payloads.sanitize(verdict.args)})
    return call


def _decided(
    agent: Agent, checkpoint: Checkpoint, call: ToolCall, decision: Approval, writes: dict[str, business.Write]
) -> ToolCall | Message | None:
    """What a decision makes of its call: a result, the approved call to run (pinned args), or None (undecided)."""
    if decision.kind == "question" and decision.status in ("approved", "rejected"):
        return (
            machine.answered(call, decision.answer)
            if decision.status == "approved"
            else machine.declined(call, decision.note)
        )
    if decision.status == "approved":
        if call.name not in agent.tools:
            raise errors.ResumeToolMissingError(
                f"the approved call {call.id!r} names tool {call.name!r}, which agent {agent.name!r} lacks"
            )
        # What runs is what the person saw and approved (after the hooks' changes at the time).
        return gate(agent, checkpoint, call.model_copy(update={"args": decision.args}), writes, pinned=True)
    if decision.status == "rejected":
        return machine.rejected(call, decision.note)
    return None


def _cleared(
    agent: Agent, checkpoint: Checkpoint, call: ToolCall, writes: dict[str, business.Write]
) -> tuple[ToolCall | Message, str]:
    """An undecided call through the gates: its result, or the call and where it goes.

    Where: ``run`` (cleared), ``gated`` (a person decides first) or ``handoff`` (recorded, never run).
    """
    tool = agent.tools.get(call.name)
    if tool is None:
        return machine.tool_error(call, "not-found", "ToolNotFound", f"no tool named {call.name!r}"), "result"
    if call.invalid_args is not None:
        return machine.tool_error(
            call, "validation", "ToolArgsInvalid", "the arguments were not a JSON object; send valid JSON"
        ), "result"
    try:
        tool.validate(call.args)
    except ToolArgsInvalid as exc:
        return machine.tool_error(call, "validation", "ToolArgsInvalid", str(exc)), "result"
    cleared = gate(agent, checkpoint, call, writes)
    if isinstance(cleared, Message):
        return cleared, "result"
    if handoffs.target_of(agent, call.name) is not None:
        return cleared, "handoff"
    if call.name in SUBAGENT_TOOLS and agent.subagents:
        return cleared, "task"
    try:
        gated = tool.requires_approval(cleared.args, reading_context(agent, checkpoint, cleared))
    except Exception as exc:  # a raising approval rule must not let the call through
        return machine.tool_error(call, "denied", "ApprovalCheckFailed", f"{type(exc).__name__}: {exc}"), "result"
    if gated:
        writes.pop(call.id, None)  # the hooks run again, and may write again, once a person approved the call
    return cleared, "gated" if gated else "run"


def sort_calls(deps: StepDeps, agent: Agent, checkpoint: Checkpoint, calls: list[ToolCall], attempt: int) -> Plan:
    """Each call through the gates, in order: argument validation, ``pre_tool_call`` hooks, ``needs_approval``.

    A call marked started without a result goes to ``worker.once`` instead (a run again goes through the hooks).

    Raises:
        HookFailedError: a hook raised (nothing of the batch was saved or run yet).
    """
    plan = Plan()
    decided = (
        {
            a.tool_call_id: a
            for a in deps.store.decisions(checkpoint.approval_ids).values()
            if a.session_id == checkpoint.session_id
        }
        if checkpoint.approval_ids
        else {}
    )
    plan.decided = {a.approval_id: call_id for call_id, a in decided.items()}
    delegated = checkpoint.delegated or {}
    order = [call.id for call in calls]
    for call in calls:
        if call.id in checkpoint.started_tool_call_ids:
            verdict = once.after_crash(agent, call, decided.get(call.id), attempt)
            if verdict == once.UNDECIDED:
                plan.undecided.append(decided[call.id].approval_id)
            elif verdict == once.RECONCILE:
                plan.reconcile.append(call)
            elif isinstance(verdict, once.Settled):
                plan.settled(verdict, call)
            elif isinstance(verdict, once.Rerun):
                rerun_once(agent, checkpoint, plan, verdict, order)
            continue
        if call.id in delegated:  # went through the gates when it was delegated
            plan.tasks.append(call)
            continue
        decision = decided.get(call.id)
        if decision is not None and decision.status == "pending":
            # A run waiting on children and on a person both (its step looks at the children): still undecided.
            plan.undecided.append(decision.approval_id)
            continue
        if decision is not None and plan.take_decision(
            _decided(agent, checkpoint, call, decision, plan.writes), decision
        ):
            continue
        cleared, where = _cleared(agent, checkpoint, call, plan.writes)
        if isinstance(cleared, Message):
            plan.results.append(cleared)
        else:
            {"gated": plan.gated, "run": plan.run, "handoff": plan.handoffs, "task": plan.tasks}[where].append(cleared)
    return plan


def rerun_once(agent: Agent, checkpoint: Checkpoint, plan: Plan, verdict: once.Rerun, order: list[str]) -> None:
    """A once call found not done runs again, through the ``pre_tool_call`` hooks as any new execution.

    Raises:
        HookFailedError: a hook raised.
    """
    gated = gate(agent, checkpoint, verdict.call, plan.writes)
    if isinstance(gated, Message):
        plan.settled(once.Settled(gated, verdict.events), verdict.call)
    else:
        plan.rerun(once.Rerun(gated, verdict.consumes, verdict.events), order)


def request_approvals(
    deps: StepDeps, agent: Agent, session_id: str, calls: list[ToolCall], asks: list[once.Ask]
) -> list[Approval]:
    """One pending approval per gated call, then one of kind ``reconcile`` per once call a person reconciles.

    A reconciliation never expires: only a person can say whether the effect happened.
    """
    fingerprint = deps.fingerprint(agent)
    # Ids sort by creation, then call order, so listings read in the order the model asked.
    stamp = f"ap_{time.time_ns():016x}"
    gated = [
        Approval(
            approval_id=f"{stamp}{k:03x}{uuid.uuid4().hex[:12]}",
            session_id=session_id,
            tool_call_id=call.id,
            tool_name=call.name,
            args=call.args,
            agent=agent.name,
            fingerprint=fingerprint,
            expires_in=_expires_in(agent, call),
            **_question_of(agent, call),
        )
        for k, call in enumerate(calls)
    ]
    return gated + [
        Approval(
            approval_id=f"{stamp}{len(calls) + k:03x}{uuid.uuid4().hex[:12]}",
            session_id=session_id,
            tool_call_id=ask.call.id,
            tool_name=ask.call.name,
            args=ask.call.args,
            agent=agent.name,
            fingerprint=fingerprint,
            kind="reconcile",
            question=ask.reason,
        )
        for k, ask in enumerate(asks)
    ]


def _expires_in(agent: Agent, call: ToolCall) -> float | None:
    """Seconds the approval of ``call`` may wait for a decision: the tool's ``expires_in``, else the agent's."""
    tool = agent.tools.get(call.name)
    own = tool.expires_in if tool is not None else None
    return own if own is not None else agent.approval_expires_in


def _question_of(agent: Agent, call: ToolCall) -> dict[str, Any]:
    """The question fields of the approval a gated call opens (none for an ordinary tool call)."""
    if not (agent.ask_question and call.name == ASK_QUESTION):
        return {}
    options = call.args.get("options")
    return {
        "kind": "question",
        "question": str(call.args.get("question", "")),
        "options": [str(option) for option in options] if isinstance(options, list) else None,
    }
