"""One tool batch: the last model turn's calls without a result, run and saved one by one.

Calls needing no approval run (up to ``tool_concurrency`` at once) and each result is saved as
soon as it settles, fitted first into what the batch may append (``payloads.MAX_TURN_RESULTS``, and
what the checkpoint has room for), so a save never fails on size after its tool ran. Calls that
need a human decision pause the run, one approval each. Once all are decided, approved calls are
marked started (saved) before they run, so a crash mid-call gives them an ``interrupted`` result
instead of a second execution.
"""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from store import errors, payloads
from store.records import Approval, Checkpoint, Lease, Message, ToolCall
from worker import machine
from worker.agents import Agent, ToolArgsInvalid, ToolContext
from worker.context import Next, Outcome, StepDeps, StepResult, save
from worker.faults import crash_point


class _Batch:
    """The checkpoint as results settle; every change is a fenced save under one lock."""

    def __init__(self, deps: StepDeps, lease: Lease, checkpoint: Checkpoint, unsettled: int) -> None:
        self.deps = deps
        self.lease = lease
        self.checkpoint = checkpoint
        self.lock = threading.Lock()
        self.closed = False
        self.fenced = False
        self.unsettled = unsettled
        self.budget = payloads.MAX_TURN_RESULTS
        self.appended = 0
        self.measured = False

    def may_start(self) -> bool:
        return not (self.closed or self.fenced or self.lease.lost.is_set())

    def _write(self, updated: Checkpoint, approvals: list[Approval] | None = None) -> bool:
        try:
            self.checkpoint = save(self.deps, updated, approvals=approvals or ())
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

    def settle(self, result: Message) -> None:
        with self.lock:
            if self.closed or self.fenced:
                return
            crash_point("after_tool_effect_before_result_save", self.checkpoint.session_id)
            if self._write(machine.record_tool_result(self.checkpoint, self._fit(result))):
                crash_point("between_results", self.checkpoint.session_id)

    def mark_started(self, call: ToolCall) -> bool:
        with self.lock:
            if self.closed or self.fenced:
                return False
            return self._write(machine.mark_started(self.checkpoint, call.id))

    def pause(self, approvals: list[Approval]) -> bool:
        with self.lock:
            if self.closed or self.fenced:
                return False
            paused = machine.pause(self.checkpoint, [a.approval_id for a in approvals])
            return self._write(paused, approvals)


@dataclass
class _Plan:
    """Each pending call sorted by what happens to it now."""

    results: list[Message] = field(default_factory=list)     # settled without running
    run: list[ToolCall] = field(default_factory=list)         # cleared to run now
    approved: list[ToolCall] = field(default_factory=list)    # decided yes: started marker first
    gated: list[ToolCall] = field(default_factory=list)       # waits for a human decision


def _context(agent: Agent, checkpoint: Checkpoint, call: ToolCall) -> ToolContext:
    return ToolContext(tool_call_id=call.id, session_id=checkpoint.session_id, agent=agent.name,
                       step=checkpoint.step, business_state=checkpoint.business_state,
                       checkpoint_seq=checkpoint.seq)


def _sort_calls(deps: StepDeps, agent: Agent, checkpoint: Checkpoint, calls: list[ToolCall]) -> _Plan:
    plan = _Plan()
    decided = {a.tool_call_id: a for a in deps.store.decisions(checkpoint.approval_ids).values()} \
        if checkpoint.approval_ids else {}
    for call in calls:
        if call.id in checkpoint.started_tool_call_ids:
            plan.results.append(machine.interrupted(call))
            continue
        decision = decided.get(call.id)
        if decision is not None and decision.status == "approved":
            if call.name not in agent.tools:
                raise errors.ResumeToolMissingError(
                    f"the approved call {call.id!r} names tool {call.name!r}, which agent {agent.name!r} lacks")
            plan.approved.append(call)
            continue
        if decision is not None and decision.status == "rejected":
            plan.results.append(machine.rejected(call, decision.note))
            continue
        tool = agent.tools.get(call.name)
        if tool is None:
            plan.results.append(machine.tool_error(call, "not-found", "ToolNotFound", f"no tool named {call.name!r}"))
            continue
        if call.invalid_args is not None:
            plan.results.append(machine.tool_error(
                call, "validation", "ToolArgsInvalid", "the arguments were not a JSON object; send valid JSON"))
            continue
        try:
            tool.validate(call.args)
            gated = tool.requires_approval(call.args, _context(agent, checkpoint, call))
        except ToolArgsInvalid as exc:
            plan.results.append(machine.tool_error(call, "validation", "ToolArgsInvalid", str(exc)))
            continue
        except Exception as exc:  # a raising approval rule must not let the call through
            plan.results.append(machine.tool_error(call, "denied", "ApprovalCheckFailed",
                                                   f"{type(exc).__name__}: {exc}"))
            continue
        (plan.gated if gated else plan.run).append(call)
    return plan


def _invoke(agent: Agent, checkpoint: Checkpoint, call: ToolCall) -> Message:
    """Run one cleared call and turn whatever happens into its result message."""
    tool = agent.tools[call.name]
    try:
        value = tool.invoke(call.args, _context(agent, checkpoint, call))
    except ToolArgsInvalid as exc:
        return machine.tool_error(call, "validation", "ToolArgsInvalid", str(exc))
    except Exception as exc:  # a raising tool becomes an error result for the model
        return machine.tool_error(call, "execution", type(exc).__name__, str(exc))
    return machine.tool_message(call, value)


def _run_cleared(batch: _Batch, agent: Agent, checkpoint: Checkpoint, calls: list[ToolCall]) -> None:
    """Run the calls cleared to run now, up to ``tool_concurrency`` at once; each result is saved as it settles."""
    sid = checkpoint.session_id

    def run_one(call: ToolCall) -> None:
        if batch.may_start():
            crash_point("tool_before_effect", sid)
            batch.settle(_invoke(agent, checkpoint, call))

    workers = min(agent.tool_concurrency, len(calls))
    if workers <= 1:
        for call in calls:
            run_one(call)
    elif calls:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lousho-tool") as pool:
            for future in [pool.submit(run_one, call) for call in calls]:
                future.result()


def _run_approved(batch: _Batch, agent: Agent, checkpoint: Checkpoint, calls: list[ToolCall]) -> None:
    """Run the approved calls one by one, each marked started (saved) before its effect."""
    sid = checkpoint.session_id
    for call in calls:
        # Durable "started" before the effect: a human approved one execution, not two.
        if not batch.mark_started(call):
            break
        crash_point("after_started_marker_before_approved_call", sid)
        result = _invoke(agent, checkpoint, call)
        crash_point("after_approved_effect_before_result_save", sid)
        batch.settle(result)


def _approvals(deps: StepDeps, agent: Agent, session_id: str, calls: list[ToolCall]) -> list[Approval]:
    """One pending approval per gated call."""
    fingerprint = deps.fingerprint(agent)
    # Ids sort by creation, then call order, so listings read in the order the model asked.
    stamp = f"ap_{time.time_ns():016x}"
    return [Approval(approval_id=f"{stamp}{k:03x}{uuid.uuid4().hex[:12]}", session_id=session_id,
                     tool_call_id=call.id, tool_name=call.name, args=call.args, agent=agent.name,
                     fingerprint=fingerprint)
            for k, call in enumerate(calls)]


def run_batch(deps: StepDeps, lease: Lease, agent: Agent, checkpoint: Checkpoint,
              calls: list[ToolCall]) -> StepResult:
    """Run the pending calls of the last turn; pause on the ones that need a human.

    Returns:
        The outcome, with the next step's message when every call has a result.
    """
    plan = _sort_calls(deps, agent, checkpoint, calls)
    # The decisions stay on the checkpoint until the turn is complete (machine.record_tool_result).
    batch = _Batch(deps, lease, checkpoint.model_copy(update={"fingerprint": deps.fingerprint(agent)}),
                   unsettled=len(calls))
    sid = checkpoint.session_id
    try:
        for result in plan.results:
            batch.settle(result)
        _run_cleared(batch, agent, checkpoint, plan.run)
        _run_approved(batch, agent, checkpoint, plan.approved)
        if plan.gated and batch.may_start() and batch.pause(_approvals(deps, agent, sid, plan.gated)):
            return StepResult(Outcome.PAUSED)
    finally:
        with batch.lock:
            batch.closed = True
    if batch.fenced or batch.checkpoint.pending_tool_calls:
        # The lease was lost before every call ran; the new holder runs the rest.
        return StepResult(Outcome.FENCED)
    crash_point("after_batch_save_before_enqueue", sid)
    return StepResult(Outcome.ADVANCED, Next(batch.checkpoint.seq, agent=checkpoint.agent))
