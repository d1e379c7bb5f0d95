"""One tool batch: the last model turn's calls without a result, run and saved one by one.

Calls needing no approval run (up to ``tool_concurrency`` at once) and each result is saved as
soon as it settles, fitted first into what the batch may append (``payloads.MAX_TURN_RESULTS``, and
what the checkpoint has room for), so a save never fails on size after its tool ran. Calls that
need a human decision pause the run, one approval each. Once all are decided, approved calls are
marked started (saved) before they run, so a crash mid-call gives them an ``interrupted`` result
instead of a second execution; ``once`` calls are marked the same way, and one found marked without a
result is reconciled (``worker.once``) before anything else of the batch runs. A handoff of a turn
that pauses is made after the last decision, once the decided calls ran as the agent that asked for them.

An abort heard meanwhile (``Lease.abort``, confirmed in Postgres) starts no more calls, sets every running
call's ``ctx.cancelled`` and, once they returned, gives each call without a result a ``cancelled`` one. A
steer (``Lease.steer`` above the batch's inbox cursor) starts no more calls either: the calls it kept
back get a "redirected" result, or, when the turn pauses for approvals, wait with the gated calls and run
after the last decision.
"""

from __future__ import annotations

import contextvars
import functools
import json
import threading
import time
import uuid
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

from store import errors, payloads, records, telemetry
from store.records import Approval, Checkpoint, EventDraft, LastError, Lease, Message, ToolCall
from worker import abort, business, handoffs, machine, once, retry, subagents, tool_threads
from worker import hooks as hook_calls
from worker import live as live_events
from worker.agents import (
    AGENT_AWAIT,
    AGENT_CANCEL,
    AGENT_STATUS,
    ASK_QUESTION,
    SUBAGENT_TOOLS,
    TASK,
    Agent,
    ToolArgsInvalid,
    ToolContext,
)
from worker.context import Next, Outcome, StepDeps, StepResult, save
from worker.faults import crash_point
from worker.hooks import Deny, HookContext, Input
from worker.hooks import Result as HookResult
from worker.live import Live


class _Batch:
    """The checkpoint as results settle; every change is a fenced save under one lock."""

    def __init__(self, deps: StepDeps, lease: Lease, checkpoint: Checkpoint, unsettled: int, live: Live) -> None:
        self.deps = deps
        self.lease = lease
        self.checkpoint = checkpoint
        self.status_before = checkpoint.status
        self.live = live
        self.lock = threading.Lock()
        self.closed = False
        self.fenced = False
        self.unsettled = unsettled
        self.budget = payloads.MAX_TURN_RESULTS
        self.appended = 0
        self.measured = False
        #: Every call's ``ctx.cancelled``: the lease's abort doorbell, set by the heartbeat as it renews the
        #: lease. A doorbell heard while the step holds the lease is real (an abort is stored before it rings,
        #: and only the lease holder settles it); ``hear`` still confirms it before the run is stopped.
        self.cancelled = lease.abort
        self.aborting = False
        self.abort_checked = False
        self.hearing = threading.Lock()
        self.steered = False
        #: The steer was deferred to after a pause's decisions: the calls it held back run then.
        self.steer_deferred = False
        self.cursor = checkpoint.inbox_cursor
        #: Child run id -> the state this step found a delegated child in while it could not give a result yet.
        self.seen: dict[str, str] = {}
        #: Call id -> the business state its ``pre_tool_call`` hooks wrote (saved with its result, unless the call
        #: writes again).
        self.writes: dict[str, business.Write] = {}

    def state_for(self, call_id: str) -> Any:
        """The business state a call starts from: its hooks' write, else the run's as the batch saved it last."""
        written = self.writes.get(call_id)
        return written.value if written is not None else self.checkpoint.business_state

    def hear(self) -> None:
        """Act on the signals the lease heard: a confirmed abort, a steer past this batch's input."""
        if self.lease.abort.is_set() and not self.abort_checked:
            with self.hearing:  # a second caller waits for the answer instead of taking "not yet" for "no"
                if not self.abort_checked:
                    self.aborting = abort.confirmed(self.deps, self.lease)
                    self.abort_checked = True
        if self.lease.steer > self.cursor and not self.steer_deferred:
            self.steered = True

    def may_start(self) -> bool:
        self.hear()
        return not (self.closed or self.fenced or self.lease.lost.is_set() or self.aborting or self.steered)

    def _write(self, updated: Checkpoint, approvals: list[Approval] | None = None,
               events: list[EventDraft] | None = None) -> bool:
        try:
            self.checkpoint = save(self.deps, updated, approvals=approvals or (), events=events or (),
                                   status_before=self.status_before, live=self.live)
        except errors.FencedOutError:
            self.fenced = True
            self.lease.lost.set()
            return False
        return True

    def _fit(self, result: Message) -> Message:
        """``result`` within its share of what the batch may still append (the largest results are cut)."""
        if not isinstance(result.content, str):
            return result
        size = payloads.text_size(result.content)
        if not self.measured and self.appended + size > payloads.MAX_TURN_RESULTS // 8:
            # Only a large batch pays for measuring the checkpoint it is appended to.
            stored = len(payloads.dumps(self.checkpoint.document()).encode("utf-8"))
            room = payloads.MAX_CHECKPOINT - stored - payloads.MAX_TURN_RESULTS // 16
            self.budget = max(min(payloads.MAX_TURN_RESULTS, room), 0)
            self.measured = True
        share = max((self.budget - self.appended) // max(self.unsettled, 1), 256)
        self.unsettled -= 1
        if size > share:
            result = result.model_copy(update={"content": payloads.fit_text(result.content, share)})
            size = payloads.text_size(result.content)
        self.appended += size
        return result

    def settle(self, result: Message, duration_ms: float | None = None, events: tuple[EventDraft, ...] = (),
               write: business.Write | None = None) -> None:
        """Save a call's result, with the business state the call (or its hooks) wrote, in one fenced save.

        A write is kept whatever the result says (an error the tool raised after writing, or ``cancelled`` when
        the run was aborted meanwhile): the code that wrote it ran. ``write`` None: the hooks' write, if any.
        """
        self.hear()
        with self.lock:
            if self.closed or self.fenced:
                return
            call_id = result.tool_call_id or ""
            hooks_wrote = self.writes.pop(call_id, None)
            write = write or hooks_wrote
            if self.aborting and not result.is_error:
                # It returned after the abort: the run stops with this call cancelled.
                result = machine.cancelled(ToolCall(id=call_id, name=result.name or ""))
            crash_point("after_tool_effect_before_result_save", self.checkpoint.session_id)
            fitted = self._fit(result)
            updated = machine.record_tool_result(self.checkpoint, fitted)
            drafts = [*events, live_events.tool_result(fitted, duration_ms)]
            if write is not None:
                updated = updated.model_copy(update={"business_state": write.value})
                drafts.append(business.changed(write, tool_call_id=call_id, tool_name=result.name))
            if self._write(updated, events=drafts):
                crash_point("between_results", self.checkpoint.session_id)

    def settle_child(self, call: ToolCall, result: Message, child: str, state: Checkpoint | None) -> None:
        """Record a delegated call's result with its child's usage folded into the run's."""
        with self.lock:
            if self.closed or self.fenced:
                return
            fitted = self._fit(result)
            updated = machine.record_tool_result(self.checkpoint, fitted)
            updated = updated.model_copy(update={"usage": updated.usage + subagents.usage_of(state)})
            self._write(updated, events=[live_events.tool_result(fitted, None), subagents.done(call, child, state)])

    def settle_background(self, call: ToolCall, result: Message, child: str, event: EventDraft) -> None:
        """Record a background task's start (its result, given at once) with the child in ``background``."""
        with self.lock:
            if self.closed or self.fenced:
                return
            fitted = self._fit(result)
            updated = machine.record_tool_result(self.checkpoint, fitted)
            updated = updated.model_copy(update={"background": [*(updated.background or []), child]})
            self._write(updated, events=[live_events.tool_result(fitted, None), event])

    def delegate(self, delegated: dict[str, str], events: list[EventDraft], paused_on: list[str]) -> None:
        """Save which calls wait on which children (``waiting`` while any has no result yet).

        ``paused_on``: approvals children wait on; the run is paused on them (``awaiting-approval``) meanwhile.
        """
        with self.lock:
            if self.closed or self.fenced:
                return
            open_calls = {c.id for c in self.checkpoint.pending_tool_calls}
            kept = {call_id: child for call_id, child in delegated.items() if call_id in open_calls}
            update: dict[str, Any] = {"delegated": kept or None, "waiting": bool(kept)}
            if paused_on:
                update.update(status="awaiting-approval", approval_ids=paused_on)
            elif self.checkpoint.status == "awaiting-approval" and self.checkpoint.waiting:
                update.update(status="in-progress", approval_ids=[])
            updated = self.checkpoint.model_copy(update=update)
            if updated == self.checkpoint and not events:
                return
            self._write(updated, events=events)

    def hand_off(self, call: ToolCall, entry: Agent, target: Agent) -> None:
        """Record a handoff: its result and the run moved to ``target`` (with its fingerprint), in one save."""
        with self.lock:
            if self.closed or self.fenced:
                return
            result = machine.tool_message(call, {"transferred_to": target.name, "from": entry.name})
            moved = machine.record_tool_result(self.checkpoint, self._fit(result)).model_copy(update={
                "active_agent": None if target.name == self.checkpoint.agent else target.name,
                "fingerprint": self.deps.fingerprint(handoffs.as_target(entry, target))})
            self._write(moved, events=[live_events.tool_result(result, None),
                                       live_events.handoff(entry.name, target.name)])

    def mark_started(self, call: ToolCall, rerun: once.Rerun | None = None) -> bool:
        """Save ``call`` as started before it runs (a call run again: with the decision it spends, and its events).

        False when the batch can no longer write (the call must not run).
        """
        with self.lock:
            if self.closed or self.fenced:
                return False
            updated = machine.mark_started(self.checkpoint, call.id)
            events: tuple[EventDraft, ...] = ()
            if rerun is not None:
                events = rerun.events
                if rerun.consumes is not None:
                    updated = machine.drop_approval(updated, rerun.consumes)
            if updated is self.checkpoint and not events:
                return True  # marked by an earlier start: nothing new to save
            return self._write(updated, events=list(events))

    def pause(self, approvals: list[Approval], decided: dict[str, str], events: list[EventDraft]) -> bool:
        """Pause on ``approvals``, keeping the decisions (approval id -> call id) of calls still without a result."""
        with self.lock:
            if self.closed or self.fenced:
                return False
            open_calls = {c.id for c in self.checkpoint.pending_tool_calls}
            kept = [a for a in self.checkpoint.approval_ids if decided.get(a) in open_calls]
            paused = machine.pause(self.checkpoint, [a.approval_id for a in approvals] + kept)
            return self._write(paused, approvals, events)


@dataclass
class _Plan:
    """Each pending call sorted by what happens to it now."""

    results: list[Message] = field(default_factory=list)     # settled without running
    notes: dict[str, tuple[EventDraft, ...]] = field(default_factory=dict)  # events saved with a settled result
    run: list[ToolCall] = field(default_factory=list)         # cleared to run now (once calls run again too)
    approved: list[ToolCall] = field(default_factory=list)    # decided yes: started marker first
    gated: list[ToolCall] = field(default_factory=list)       # waits for a human decision
    handoffs: list[ToolCall] = field(default_factory=list)    # transfer_to_<name>: recorded, never run
    tasks: list[ToolCall] = field(default_factory=list)       # task: a child run gives the result
    undecided: list[str] = field(default_factory=list)        # approvals of calls still waiting for a person
    approval_of: dict[str, str] = field(default_factory=dict)  # approved call id -> the approval that let it run
    reconcile: list[ToolCall] = field(default_factory=list)   # once calls found started without a result
    reruns: dict[str, once.Rerun] = field(default_factory=dict)  # once calls found not done: they run again
    asks: list[once.Ask] = field(default_factory=list)        # once calls a person reconciles
    decided: dict[str, str] = field(default_factory=dict)     # approval id -> call id of the turn's decisions
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


def _context(agent: Agent, checkpoint: Checkpoint, call: ToolCall, cancelled: threading.Event | None = None,
             attempt: int = 1, approval_id: str | None = None, state: Any = None) -> ToolContext:
    """The context of a call that runs, starting from business state ``state`` (a copy of it)."""
    return ToolContext(tool_call_id=call.id, session_id=checkpoint.session_id, agent=agent.name,
                       step=checkpoint.step, business_state=business.handed(state),
                       checkpoint_seq=checkpoint.seq, cancelled=cancelled or threading.Event(), attempt=attempt,
                       approval_id=approval_id)


def _reading_context(agent: Agent, checkpoint: Checkpoint, call: ToolCall, cancelled: threading.Event | None = None,
                     attempt: int = 1) -> ToolContext:
    """The context of a function that only reads (an approval rule, ``reconcile``): it cannot write the state."""
    return business.read_only(_context(agent, checkpoint, call, cancelled, attempt,
                                       state=checkpoint.business_state))


def _hook_context(agent: Agent, checkpoint: Checkpoint, call: ToolCall, resumed: bool = False,
                  state: Any = None) -> HookContext:
    return HookContext(session_id=checkpoint.session_id, agent=agent.name, step=checkpoint.step,
                       metadata=checkpoint.metadata, tool_call_id=call.id, tool_name=call.name, args=dict(call.args),
                       resumed_after_approval=resumed, business_state=business.handed(state))


def _same_args(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two argument objects are equal as JSON (key order aside)."""
    return json.dumps(payloads.sanitize(a), sort_keys=True) == json.dumps(payloads.sanitize(b), sort_keys=True)


def _gate(agent: Agent, checkpoint: Checkpoint, call: ToolCall, writes: dict[str, business.Write],
          pinned: bool = False) -> ToolCall | Message:
    """The call as the ``pre_tool_call`` hooks leave it, or the result they settle it with.

    ``pinned``: a person approved ``call.args``; a hook that changes them gets the call a validation error.
    A business state the hooks wrote goes in ``writes`` (saved with the call's result).

    Raises:
        HookFailedError: a hook raised, or wrote a business state that cannot be saved.
    """
    hooks = hook_calls.having(agent.hooks, "pre_tool_call")
    if not hooks:
        return call
    ctx = _hook_context(agent, checkpoint, call, resumed=pinned, state=checkpoint.business_state)
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
                return machine.tool_error(call, "validation", "ApprovedArgsChanged",
                                          "a hook tried to change the arguments a person approved; the call did"
                                          " not run")
            return call
        try:
            agent.tools[call.name].validate(verdict.args)
        except ToolArgsInvalid as exc:
            return machine.tool_error(call, "validation", "ToolArgsInvalid", f"arguments from a hook: {exc}")
        return call.model_copy(update={"args": payloads.sanitize(verdict.args)})
    return call


def _decided(agent: Agent, checkpoint: Checkpoint, call: ToolCall, decision: Approval,
             writes: dict[str, business.Write]) -> ToolCall | Message | None:
    """What a decision makes of its call: a result, the approved call to run (pinned args), or None (undecided)."""
    if decision.kind == "question" and decision.status in ("approved", "rejected"):
        return machine.answered(call, decision.answer) if decision.status == "approved" \
            else machine.declined(call, decision.note)
    if decision.status == "approved":
        if call.name not in agent.tools:
            raise errors.ResumeToolMissingError(
                f"the approved call {call.id!r} names tool {call.name!r}, which agent {agent.name!r} lacks")
        # What runs is what the person saw and approved (after the hooks' changes at the time).
        return _gate(agent, checkpoint, call.model_copy(update={"args": decision.args}), writes, pinned=True)
    if decision.status == "rejected":
        return machine.rejected(call, decision.note)
    return None


def _cleared(agent: Agent, checkpoint: Checkpoint, call: ToolCall,
             writes: dict[str, business.Write]) -> tuple[ToolCall | Message, str]:
    """An undecided call through the gates: its result, or the call and where it goes.

    Where: ``run`` (cleared), ``gated`` (a person decides first) or ``handoff`` (recorded, never run).
    """
    tool = agent.tools.get(call.name)
    if tool is None:
        return machine.tool_error(call, "not-found", "ToolNotFound", f"no tool named {call.name!r}"), "result"
    if call.invalid_args is not None:
        return machine.tool_error(call, "validation", "ToolArgsInvalid",
                                  "the arguments were not a JSON object; send valid JSON"), "result"
    try:
        tool.validate(call.args)
    except ToolArgsInvalid as exc:
        return machine.tool_error(call, "validation", "ToolArgsInvalid", str(exc)), "result"
    cleared = _gate(agent, checkpoint, call, writes)
    if isinstance(cleared, Message):
        return cleared, "result"
    if handoffs.target_of(agent, call.name) is not None:
        return cleared, "handoff"
    if call.name in SUBAGENT_TOOLS and agent.subagents:
        return cleared, "task"
    try:
        gated = tool.requires_approval(cleared.args, _reading_context(agent, checkpoint, cleared))
    except Exception as exc:  # a raising approval rule must not let the call through
        return machine.tool_error(call, "denied", "ApprovalCheckFailed", f"{type(exc).__name__}: {exc}"), "result"
    if gated:
        writes.pop(call.id, None)  # the hooks run again, and may write again, once a person approved the call
    return cleared, "gated" if gated else "run"


def _sort_calls(deps: StepDeps, agent: Agent, checkpoint: Checkpoint, calls: list[ToolCall], attempt: int) -> _Plan:
    """Each call through the gates, in order: argument validation, ``pre_tool_call`` hooks, ``needs_approval``.

    A call marked started without a result goes to ``worker.once`` instead (a run again goes through the hooks).

    Raises:
        HookFailedError: a hook raised (nothing of the batch was saved or run yet).
    """
    plan = _Plan()
    decided = {a.tool_call_id: a for a in deps.store.decisions(checkpoint.approval_ids).values()
               if a.session_id == checkpoint.session_id} if checkpoint.approval_ids else {}
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
                _rerun(agent, checkpoint, plan, verdict, order)
            continue
        if call.id in delegated:  # went through the gates when it was delegated
            plan.tasks.append(call)
            continue
        decision = decided.get(call.id)
        if decision is not None and decision.status == "pending":
            # A run waiting on children and on a person both (its step looks at the children): still undecided.
            plan.undecided.append(decision.approval_id)
            continue
        if decision is not None and plan.take_decision(_decided(agent, checkpoint, call, decision, plan.writes),
                                                       decision):
            continue
        cleared, where = _cleared(agent, checkpoint, call, plan.writes)
        if isinstance(cleared, Message):
            plan.results.append(cleared)
        else:
            {"gated": plan.gated, "run": plan.run, "handoff": plan.handoffs, "task": plan.tasks}[where].append(cleared)
    return plan


def _rerun(agent: Agent, checkpoint: Checkpoint, plan: _Plan, verdict: once.Rerun, order: list[str]) -> None:
    """A once call found not done runs again, through the ``pre_tool_call`` hooks as any new execution.

    Raises:
        HookFailedError: a hook raised.
    """
    gated = _gate(agent, checkpoint, verdict.call, plan.writes)
    if isinstance(gated, Message):
        plan.settled(once.Settled(gated, verdict.events), verdict.call)
    else:
        plan.rerun(once.Rerun(gated, verdict.consumes, verdict.events), order)


_Invoked = tuple[Message, "business.Write | None"]


def _invoke(agent: Agent, checkpoint: Checkpoint, call: ToolCall, cancelled: threading.Event,
            attempt: int = 1, approval_id: str | None = None, state: Any = None) -> _Invoked:
    """Run one cleared call, starting from business state ``state``: its result message and what it wrote.

    Whatever happens becomes the result; a tool that raised after writing the state keeps its write (it is saved
    with the error result). A write that cannot be saved (not JSON, too large) makes the result an error that
    says so, and is dropped.
    """
    tool = agent.tools[call.name]
    context = _context(agent, checkpoint, call, cancelled, attempt, approval_id, state)
    try:
        value = tool.invoke(call.args, context)
    except ToolArgsInvalid as exc:
        return machine.tool_error(call, "validation", "ToolArgsInvalid", str(exc)), None
    except (errors.PropagatingToolError, errors.HookFailedError):
        raise  # the tool (or a hook) stops the run: no result, no further call (worker.steps records it)
    except Exception as exc:  # a raising tool becomes an error result for the model
        result = machine.tool_error(call, "execution", type(exc).__name__, str(exc))
    else:
        result = machine.tool_message(call, value)
    try:
        return result, business.written(state, context.business_state, "tool")
    except business.InvalidWrite as exc:
        return machine.tool_error(call, "execution", "BusinessStateInvalid", str(exc)), None


class _CallCancelled(threading.Event):
    """``ctx.cancelled`` of a call with a timeout: set when it times out, and whenever the run is aborted."""

    def __init__(self, abort: threading.Event) -> None:
        super().__init__()
        self._abort = abort

    def is_set(self) -> bool:
        """Whether the call should stop (timed out, or the run aborted)."""
        return super().is_set() or self._abort.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the call should stop (True) or ``timeout`` passed (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.is_set():
            remaining = 0.05 if deadline is None else min(deadline - time.monotonic(), 0.05)
            if remaining <= 0:
                return False
            super().wait(remaining)
        return True


def _invoke_within(agent: Agent, checkpoint: Checkpoint, call: ToolCall, abort: threading.Event,
                   timeout: float, attempt: int = 1, approval_id: str | None = None, state: Any = None) -> _Invoked:
    """Run a call that has a timeout on the process's tool threads; its result, whatever happens.

    A call that found no free thread within ``timeout`` is cancelled: it never runs, and its result says so
    (``not-run``), so the model may ask again without anything happening twice. A call that started gets its
    whole ``timeout`` from its start; past it, it is told through ``ctx.cancelled``, its answer (if one comes)
    is dropped, its result says it may still take effect, and its thread is replaced; what it writes into the
    business state then is dropped too (it may still be writing).
    """
    threads = tool_threads.process_threads()
    cancelled = _CallCancelled(abort)
    running = threads.submit(_invoke, agent, checkpoint, call, cancelled, attempt, approval_id, state)
    try:
        outcome = threads.wait(running, timeout)
    except BaseException:
        # The step is going away (its time limit): a call that did not start must never start later.
        if not running.cancel():
            cancelled.set()
            threads.abandon(running)
        raise
    if outcome == "done":
        return running.result()
    if outcome == "not-started":
        return machine.tool_error(call, "not-run", "ToolNotStarted",
                                  f"no worker thread was free for this call within its {timeout:g} s timeout;"
                                  " it did not run and never will"), None
    cancelled.set()
    timed_out = machine.tool_error(call, "timeout", "ToolTimedOut",
                                   f"the call ran longer than {timeout:g} s and was given up; it may still take effect")
    return timed_out, None


def _timed_invoke(batch: _Batch, agent: Agent, checkpoint: Checkpoint, call: ToolCall,
                  resumed: bool = False, attempt: int = 1,
                  approval_id: str | None = None) -> tuple[Message, float, business.Write | None]:
    """Run a call and its ``post_tool_call`` hooks: its result, how long it took, and the business state written.

    The state flows from the call's ``pre_tool_call`` hooks (or the run's) through the tool to the post hooks;
    the last write wins, and it is saved with the result.
    """
    batch.live.tool_start(call)
    started, started_ns = time.perf_counter(), time.time_ns()
    tool = agent.tools.get(call.name)
    state = batch.state_for(call.id)
    if tool is None or tool.timeout is None:
        result, write = _invoke(agent, checkpoint, call, batch.cancelled, attempt, approval_id, state)
    else:
        result, write = _invoke_within(agent, checkpoint, call, batch.cancelled, tool.timeout, attempt, approval_id,
                                       state)
    result, after = _after(agent, checkpoint, call, result, resumed, write.value if write is not None else state)
    telemetry.tool_call(call.name, call.id, _outcome(result), started_ns)
    return result, (time.perf_counter() - started) * 1000, after or write


def _outcome(result: Message) -> str:
    """``ok``, or the kind of error a tool result is (``error``, ``timeout``, ...), for metrics and traces."""
    if not result.is_error:
        return "ok"
    try:
        kind = json.loads(result.content).get("kind") if isinstance(result.content, str) else None
    except (ValueError, AttributeError):
        kind = None
    return kind if isinstance(kind, str) and kind.isidentifier() and len(kind) <= 32 else "error"


def _after(agent: Agent, checkpoint: Checkpoint, call: ToolCall, result: Message, resumed: bool,
           state: Any) -> tuple[Message, business.Write | None]:
    """``result`` as the ``post_tool_call`` hooks leave it, and the business state they wrote (from ``state``).

    Raises:
        HookFailedError: a hook raised, or wrote a state that cannot be saved (the call gets no result; it runs
            again on resume).
    """
    hooks = hook_calls.having(agent.hooks, "post_tool_call")
    if not hooks:
        return result, None
    ctx = _hook_context(agent, checkpoint, call, resumed, state)
    replaced = hook_calls.post_tool_call(hooks, ctx, result)
    write = business.hook_written(state, ctx)
    if replaced is None:
        return result, write
    return machine.tool_message(call, replaced.value, replaced_by_hook=True), write


def _in_pool(batch: _Batch, workers: int, jobs: list[Callable[[], None]]) -> None:
    """Run ``jobs`` in call order, ``workers`` at a time, the step's thread acting on the lease's signals meanwhile.

    An abort heard while calls run sets their ``ctx.cancelled`` (``_Batch.hear``); jobs not started yet see
    ``may_start`` refuse them. Returns once every job returned; the first job error is raised then. The jobs run
    on the process's tool threads (``worker.tool_threads``: kept across batches, since starting threads for
    every batch cost more than a small step does) and never wait for one: a busy set gives them their own.
    """
    if workers <= 1:
        # One at a time: in the step's own thread (no hand-over), the signals heard between calls; a running
        # call hears an abort through ``ctx.cancelled``, which the heartbeat sets.
        for job in jobs:
            batch.hear()
            job()
        return
    pool, waiting = tool_threads.process_threads(), list(jobs)
    running: list[futures.Future[None]] = []
    wake = batch.lease.wake
    finished_normally = False
    try:
        while waiting or running:
            while waiting and len(running) < workers:
                # In a copy of the step's context: what the calls record lands in the step's report.
                future = pool.submit(contextvars.copy_context().run, waiting.pop(0), at_once=True)
                future.add_done_callback(lambda _: wake.set())
                running.append(future)
            batch.hear()
            finished = [future for future in running if future.done()]
            if not finished:
                wake.wait()
                wake.clear()
                continue
            for done in finished:
                running.remove(done)
                done.result()
        finished_normally = True
    finally:
        if not finished_normally:
            pool.cancel_waiting(running)  # jobs that have not started never start once the batch gave up
        futures.wait(running)


def _run_cleared(batch: _Batch, agent: Agent, checkpoint: Checkpoint, calls: list[ToolCall], attempt: int,
                 reruns: dict[str, once.Rerun]) -> None:
    """Run the calls cleared to run now, up to ``tool_concurrency`` at once; each result is saved as it settles.

    ``once`` calls are marked started first (``_run_marked``); one run again counts at least as attempt 2.
    """
    sid = checkpoint.session_id

    def run_one(call: ToolCall) -> None:
        if not batch.may_start():
            return
        tool = agent.tools.get(call.name)
        if tool is not None and tool.once:
            rerun = reruns.get(call.id)
            _run_marked(batch, agent, checkpoint, call, max(attempt, 2) if rerun else attempt, rerun=rerun)
            return
        crash_point("tool_before_effect", sid)
        result, duration, write = _timed_invoke(batch, agent, checkpoint, call, attempt=attempt)
        batch.settle(result, duration, write=write)

    _in_pool(batch, min(agent.tool_concurrency, len(calls)), [functools.partial(run_one, call) for call in calls])


def _run_marked(batch: _Batch, agent: Agent, checkpoint: Checkpoint, call: ToolCall, attempt: int, *,
                approved: bool = False, rerun: once.Rerun | None = None, approval_id: str | None = None) -> bool:
    """Run a call that must not run twice, marked started by a fenced save before its effect; False if unmarked.

    One mechanism for approved calls (a person approved one execution) and ``once`` calls; what a later step makes
    of a mark without a result differs (``worker.once.after_crash``).
    """
    sid = checkpoint.session_id
    crash_point("before_started_marker", sid)
    if not batch.mark_started(call, rerun):
        return False
    crash_point("after_started_marker_before_approved_call" if approved else "after_started_marker_before_once_call",
                sid)
    result, duration, write = _timed_invoke(batch, agent, checkpoint, call, resumed=approved, attempt=attempt,
                                            approval_id=approval_id)
    crash_point("after_approved_effect_before_result_save" if approved else "after_once_effect_before_result_save",
                sid)
    batch.settle(result, duration, write=write)
    return True


def _run_approved(batch: _Batch, agent: Agent, checkpoint: Checkpoint, calls: list[ToolCall],
                  approval_of: dict[str, str]) -> None:
    """Run the approved calls one by one in the step's thread, each marked started (saved) before its effect.

    An approved call runs at most once (I5), so it is always attempt 1.
    """
    for call in calls:
        if not batch.may_start() or not _run_marked(batch, agent, checkpoint, call, 1, approved=True,
                                                    approval_id=approval_of.get(call.id)):
            break


def _reconcile(batch: _Batch, agent: Agent, checkpoint: Checkpoint, plan: _Plan, attempt: int) -> StepResult | None:
    """Reconcile the once calls found started without a result, before anything else of the batch runs.

    Each gets a result, runs again, or waits for a person (``plan``). A ``reconcile`` that raised fails the step as a
    transient failure (the returned result; nothing of the batch ran), until the retry budget is spent.
    """
    if not plan.reconcile:
        return None
    now = batch.live.db_now()

    def retry_spent() -> float | None:
        spent = retry.retried_for(checkpoint, now)
        return spent if spent >= batch.deps.retry_for_s else None

    order = [call.id for call in batch.checkpoint.pending_tool_calls]
    for call in plan.reconcile:
        context = _reading_context(agent, checkpoint, call, batch.cancelled, max(attempt, 2))
        verdict = once.reconcile(agent, call, context, retry_spent)
        if isinstance(verdict, once.Failed):
            error = LastError(**verdict.error.to_record())
            return retry.retry_later(batch.deps, checkpoint, error, None, now, events=verdict.events)
        if isinstance(verdict, once.Settled):
            plan.settled(verdict, call)
        elif isinstance(verdict, once.Rerun):
            _rerun(agent, checkpoint, plan, verdict, order)
        else:
            plan.asks.append(verdict)
    return None


def _hand_off(batch: _Batch, agent: Agent, calls: list[ToolCall]) -> None:
    """Honour the turn's first handoff (within ``max_handoffs``); the others get ``not-run`` results."""
    for index, call in enumerate(calls):
        target = handoffs.target_of(agent, call.name)
        assert target is not None
        if index > 0:
            batch.settle(machine.tool_error(call, "not-run", "HandoffNotHonoured",
                                            "only the first handoff of a turn is made; this one was not"))
        elif handoffs.handoffs_in_input(batch.checkpoint) >= agent.max_handoffs:
            batch.settle(machine.tool_error(call, "denied", "TooManyHandoffs",
                                            f"this run already handed off {agent.max_handoffs} times"))
        else:
            batch.hand_off(call, agent, target)


def _delegate(batch: _Batch, agent: Agent, calls: list[ToolCall], undecided: list[str]) -> list[tuple[str, str | None]]:
    """Record the result of each delegated call whose child settled, then start children for new ``task`` calls.

    At most ``tool_concurrency`` children run at once; the other calls wait for a free place (a settling child
    wakes the run). The run stays paused while a child waits on an approval or ``undecided`` (its own) are not
    decided yet. Children are started under the run's fence (``StepStore.start_children``): a batch that lost its
    lease, or whose run was deleted meanwhile, starts none. Returns the children to send a step (the new ones),
    once the save that names them is durable.
    """
    if not calls or batch.fenced:
        return []
    lead = batch.checkpoint.session_id
    # Only the run's own children count: a child named by another run (a fork of a release that copied its
    # source's) is not waited on, and its call gets a child of this run's.
    own = {call_id: child for call_id, child in (batch.checkpoint.delegated or {}).items()
           if records.lead_of(child) == lead}
    delegated = dict(own)
    paused_on = _settle_delegated(batch, delegated, {call.id: call for call in calls})
    new: list[tuple[ToolCall, str]] = []
    events: list[EventDraft] = []
    sent: list[tuple[str, str | None]] = []
    for call in calls:
        if call.id in delegated or call.id in own:
            continue
        if call.name != TASK:
            _follow_background(batch, call, delegated, sent)
            continue
        background = bool(call.args.get("background"))
        if len(delegated) >= agent.tool_concurrency and not background:
            continue  # started when a child settles
        started = subagents.child_id(lead, batch.checkpoint.step, call.id)
        if records.depth_of(lead) + 1 > agent.max_subagent_depth:
            batch.settle(machine.tool_error(call, "denied", "SubagentDepthExceeded",
                                            f"sub-agents may nest {agent.max_subagent_depth} level(s) deep"))
        elif started is None:
            batch.settle(machine.tool_error(call, "execution", "SubagentIdTooLong",
                                            "this run's id is too long to name a sub-agent's run"))
        elif background:
            if _start(batch, [(call, started)]):
                batch.settle_background(call, machine.tool_message(call, {
                    "task_id": started, "status": "running", "agent": call.args["agent"]}), started,
                    subagents.started(call, started))
                sent.append((started, str(call.args["agent"])))
        else:
            delegated[call.id] = started
            new.append((call, started))
    started_now = _start(batch, new)
    for call, child in new:
        if child in started_now:
            events.append(subagents.started(call, child))
        else:
            del delegated[call.id]
    batch.delegate(delegated, events, undecided + paused_on)
    return sent + [(child, str(call.args["agent"])) for call, child in new if child in started_now]


def _start(batch: _Batch, children: list[tuple[ToolCall, str]]) -> set[str]:
    """Create the child runs of ``children`` (``task`` calls and the ids of their runs) under the batch's fence.

    Returns the ids started (or found started by an earlier run of this step). A call whose id another run took
    gets an error result; a batch fenced out starts none (and its lease is lost).
    """
    if not children or batch.fenced:
        return set()
    try:
        refused = set(batch.deps.store.start_children(
            batch.checkpoint.session_id, batch.checkpoint.agent,
            [(child, str(call.args["agent"]), str(call.args["prompt"])) for call, child in children],
            fence=batch.checkpoint.fence))
    except errors.FencedOutError:
        batch.fenced = True
        batch.lease.lost.set()
        return set()
    for call, child in children:
        if child in refused:
            batch.settle(machine.tool_error(call, "execution", "SubagentIdTaken",
                                            f"a run named {child!r} exists and is not this run's sub-agent;"
                                            " the task did not start"))
    return {child for _, child in children if child not in refused}


def _settle_delegated(batch: _Batch, delegated: dict[str, str], calls: dict[str, ToolCall]) -> list[str]:
    """Record the results of the delegated calls whose child settled (dropping them from ``delegated``).

    Returns the approvals children wait on.
    """
    paused_on: list[str] = []
    for call_id, child in list(delegated.items()):
        if call_id not in calls:
            continue
        state = batch.deps.store.load(child)
        result = subagents.result_of(calls[call_id], state)
        if result is not None:
            batch.settle_child(calls[call_id], result, child, state)
            del delegated[call_id]
        else:
            batch.seen[child] = subagents.state_of(state)
            if batch.seen[child] == "awaiting-approval" and state is not None:
                paused_on.extend(state.approval_ids)
    return paused_on


def _watch(batch: _Batch) -> tuple[tuple[str, str], ...]:
    """The children the run waits on once the step ends, with the state the step found each in.

    A child started or awaited by this step was not read: it counts as running.
    """
    return tuple((child, batch.seen.get(child, "running")) for child in (batch.checkpoint.delegated or {}).values())


def _follow_background(batch: _Batch, call: ToolCall, delegated: dict[str, str],
                       sent: list[tuple[str, str | None]]) -> None:
    """``agent_status``, ``agent_cancel`` (answered now) or ``agent_await`` (delegated to the task's child)."""
    task_id = str(call.args.get("task_id", ""))
    if task_id not in (batch.checkpoint.background or []) or records.lead_of(task_id) != batch.checkpoint.session_id:
        batch.settle(machine.tool_error(call, "not-found", "TaskNotFound",
                                        f"no background task {task_id!r} in this run"))
    elif call.name == AGENT_AWAIT:
        delegated[call.id] = task_id
    elif call.name == AGENT_STATUS:
        batch.settle(machine.tool_message(call, subagents.status_of(task_id, batch.deps.store.load(task_id))))
    elif call.name == AGENT_CANCEL:
        batch.deps.store.request_abort(task_id)
        sent.append((task_id, None))
        batch.settle(machine.tool_message(call, {"task_id": task_id, "cancelled": True}))


def _approvals(deps: StepDeps, agent: Agent, session_id: str, calls: list[ToolCall],
               asks: list[once.Ask]) -> list[Approval]:
    """One pending approval per gated call, then one of kind ``reconcile`` per once call a person reconciles.

    A reconciliation never expires: only a person can say whether the effect happened.
    """
    fingerprint = deps.fingerprint(agent)
    # Ids sort by creation, then call order, so listings read in the order the model asked.
    stamp = f"ap_{time.time_ns():016x}"
    gated = [Approval(approval_id=f"{stamp}{k:03x}{uuid.uuid4().hex[:12]}", session_id=session_id,
                      tool_call_id=call.id, tool_name=call.name, args=call.args, agent=agent.name,
                      fingerprint=fingerprint, expires_in=_expires_in(agent, call), **_question_of(agent, call))
             for k, call in enumerate(calls)]
    return gated + [Approval(approval_id=f"{stamp}{len(calls) + k:03x}{uuid.uuid4().hex[:12]}", session_id=session_id,
                             tool_call_id=ask.call.id, tool_name=ask.call.name, args=ask.call.args, agent=agent.name,
                             fingerprint=fingerprint, kind="reconcile", question=ask.reason)
                    for k, ask in enumerate(asks)]


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
    return {"kind": "question", "question": str(call.args.get("question", "")),
            "options": [str(option) for option in options] if isinstance(options, list) else None}


def _pause(batch: _Batch, agent: Agent, plan: _Plan) -> bool:
    """Pause the run on the gated calls' approvals and the reconciliations a person decides; False if it cannot.

    The calls a steer kept back wait with them and run after the last decision.
    """
    deps, sid = batch.deps, batch.checkpoint.session_id
    if batch.steered:
        if deps.signals is not None:
            deps.signals.clear_steer(sid)
        batch.steered, batch.steer_deferred = False, True
    return batch.may_start() and batch.pause(_approvals(deps, agent, sid, plan.gated, plan.asks), plan.decided,
                                             [event for ask in plan.asks for event in ask.events])


def run_batch(deps: StepDeps, lease: Lease, agent: Agent, checkpoint: Checkpoint,
              calls: list[ToolCall], live: Live) -> StepResult:
    """Run the pending calls of the last turn; pause on the ones that need a human.

    A confirmed abort stops the run (``worker.abort``) once the running calls returned.

    Returns:
        The outcome, with the next step's message when every call has a result.
    """
    attempt = machine.attempt_of(checkpoint)
    plan = _sort_calls(deps, agent, checkpoint, calls, attempt)
    # The decisions stay on the checkpoint until the turn is complete (machine.record_tool_result).
    batch = _Batch(deps, lease, checkpoint.model_copy(update={"fingerprint": deps.fingerprint(agent)}),
                   unsettled=len(calls), live=live)
    batch.writes = plan.writes
    sid = checkpoint.session_id
    try:
        failed = _reconcile(batch, agent, checkpoint, plan, attempt)
        if failed is not None:
            return failed
        for result in plan.results:
            batch.settle(result, events=plan.notes.get(result.tool_call_id or "", ()))
        _run_cleared(batch, agent, checkpoint, plan.run, attempt, plan.reruns)
        _run_approved(batch, agent, checkpoint, plan.approved, plan.approval_of)
        gating = plan.gated or plan.asks
        if not (gating or plan.undecided):
            # While a person still decides a call of this turn the handoff waits, as the calls a steer held back
            # do: the calls decided later run as the agent that asked for them, and the run moves after them.
            _hand_off(batch, agent, plan.handoffs)
        children = _delegate(batch, agent, plan.tasks, plan.undecided)
        batch.hear()
        if batch.aborting and not batch.fenced:
            batch.closed = True
            return abort.settle(deps, batch.checkpoint, live, None, drained=False)
        if gating and _pause(batch, agent, plan):
            return StepResult(Outcome.PAUSED, also=tuple(children), watch=_watch(batch))
        if batch.steered and not batch.fenced:
            for call in batch.checkpoint.pending_tool_calls:
                batch.settle(machine.redirected(call))
            if batch.checkpoint.delegated:
                # A redirected ``task`` call no longer waits on its child (which runs on; its wake finds nothing
                # left to do): the run must not stay ``waiting`` on a call that has its result.
                batch.delegate(dict(batch.checkpoint.delegated), [], [])
    finally:
        with batch.lock:
            batch.closed = True
    if batch.fenced:
        return StepResult(Outcome.FENCED)
    if batch.checkpoint.waiting:
        # Children run on their own; the last to settle wakes this run.
        outcome = Outcome.PAUSED if batch.checkpoint.status == "awaiting-approval" else Outcome.DELEGATED
        return StepResult(outcome, also=tuple(children), watch=_watch(batch))
    if batch.checkpoint.pending_tool_calls:
        # The lease was lost before every call ran; the new holder runs the rest.
        return StepResult(Outcome.FENCED)
    crash_point("after_batch_save_before_enqueue", sid)
    return StepResult(Outcome.ADVANCED, Next(batch.checkpoint.seq, agent=batch.checkpoint.current_agent),
                      also=tuple(children))
