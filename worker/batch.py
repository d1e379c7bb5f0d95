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

The batch's parts live beside it: its shared state and saves (``worker.batch_state``), the gates each call goes
through (``worker.gates``), running one call (``worker.invocation``) and its ``task`` calls (``worker.delegation``);
this module runs them in order.
"""

from __future__ import annotations

import contextvars
import functools
import time
from collections.abc import Callable
from concurrent import futures

from store import telemetry
from store.records import Checkpoint, LastError, Lease, Message, ToolCall
from worker import (
    abort,
    batch_state,
    business,
    delegation,
    gates,
    handoffs,
    invocation,
    machine,
    once,
    retry,
    tool_threads,
)
from worker.agents import Agent
from worker.context import Next, Outcome, StepDeps, StepResult
from worker.faults import crash_point
from worker.live import Live


def _timed_invoke(
    batch: batch_state.Batch,
    agent: Agent,
    checkpoint: Checkpoint,
    call: ToolCall,
    resumed: bool = False,
    attempt: int = 1,
    approval_id: str | None = None,
) -> tuple[Message, float, business.Write | None]:
    """Run a call and its ``post_tool_call`` hooks: its result, how long it took, and the business state written.

    The state flows from the call's ``pre_tool_call`` hooks (or the run's) through the tool to the post hooks;
    the last write wins, and it is saved with the result.
    """
    batch.live.tool_start(call)
    started, started_ns = time.perf_counter(), time.time_ns()
    tool = agent.tools.get(call.name)
    state = batch.state_for(call.id)
    if tool is None or tool.timeout is None:
        result, write = invocation.invoke(agent, checkpoint, call, batch.cancelled, attempt, approval_id, state)
    else:
        result, write = invocation.invoke_within(
            agent, checkpoint, call, batch.cancelled, tool.timeout, attempt, approval_id, state
        )
    result, after = invocation.after_hooks(
        agent, checkpoint, call, result, resumed, write.value if write is not None else state
    )
    telemetry.tool_call(call.name, call.id, invocation.outcome_of(result), started_ns)
    return result, (time.perf_counter() - started) * 1000, after or write


def _in_pool(batch: batch_state.Batch, workers: int, jobs: list[Callable[[], None]]) -> None:
    """Run ``jobs`` in call order, ``workers`` at a time, the step's thread acting on the lease's signals meanwhile.

    An abort heard while calls run sets their ``ctx.cancelled`` (``batch_state.Batch.hear``); jobs not started yet see
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


def _run_cleared(
    batch: batch_state.Batch,
    agent: Agent,
    checkpoint: Checkpoint,
    calls: list[ToolCall],
    attempt: int,
    reruns: dict[str, once.Rerun],
) -> None:
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


def _run_marked(
    batch: batch_state.Batch,
    agent: Agent,
    checkpoint: Checkpoint,
    call: ToolCall,
    attempt: int,
    *,
    approved: bool = False,
    rerun: once.Rerun | None = None,
    approval_id: str | None = None,
) -> bool:
    """Run a call that must not run twice, marked started by a fenced save before its effect; False if unmarked.

    One mechanism for approved calls (a person approved one execution) and ``once`` calls; what a later step makes
    of a mark without a result differs (``worker.once.after_crash``).
    """
    sid = checkpoint.session_id
    crash_point("before_started_marker", sid)
    if not batch.mark_started(call, rerun):
        return False
    crash_point(
        "after_started_marker_before_approved_call" if approved else "after_started_marker_before_once_call", sid
    )
    result, duration, write = _timed_invoke(
        batch, agent, checkpoint, call, resumed=approved, attempt=attempt, approval_id=approval_id
    )
    crash_point("after_approved_effect_before_result_save" if approved else "after_once_effect_before_result_save", sid)
    batch.settle(result, duration, write=write)
    return True


def _run_approved(
    batch: batch_state.Batch, agent: Agent, checkpoint: Checkpoint, calls: list[ToolCall], approval_of: dict[str, str]
) -> None:
    """Run the approved calls one by one in the step's thread, each marked started (saved) before its effect.

    An approved call runs at most once (I5), so it is always attempt 1.
    """
    for call in calls:
        if not batch.may_start() or not _run_marked(
            batch, agent, checkpoint, call, 1, approved=True, approval_id=approval_of.get(call.id)
        ):
            break


def _reconcile(
    batch: batch_state.Batch, agent: Agent, checkpoint: Checkpoint, plan: gates.Plan, attempt: int
) -> StepResult | None:
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
        context = gates.reading_context(agent, checkpoint, call, batch.cancelled, max(attempt, 2))
        verdict = once.reconcile(agent, call, context, retry_spent)
        if isinstance(verdict, once.Failed):
            error = LastError(**verdict.error.to_record())
            return retry.retry_later(batch.deps, checkpoint, error, None, now, events=verdict.events)
        if isinstance(verdict, once.Settled):
            plan.settled(verdict, call)
        elif isinstance(verdict, once.Rerun):
            gates.rerun_once(agent, checkpoint, plan, verdict, order)
        else:
            plan.asks.append(verdict)
    return None


def _hand_off(batch: batch_state.Batch, agent: Agent, calls: list[ToolCall]) -> None:
    """Honour the turn's first handoff (within ``max_handoffs``); the others get ``not-run`` results."""
    for index, call in enumerate(calls):
        target = handoffs.target_of(agent, call.name)
        assert target is not None
        if index > 0:
            batch.settle(
                machine.tool_error(
                    call, "not-run", "HandoffNotHonoured", "only the first handoff of a turn is made; this one was not"
                )
            )
        elif handoffs.handoffs_in_input(batch.checkpoint) >= agent.max_handoffs:
            batch.settle(
                machine.tool_error(
                    call, "denied", "TooManyHandoffs", f"this run already handed off {agent.max_handoffs} times"
                )
            )
        else:
            batch.hand_off(call, agent, target)


def _pause(batch: batch_state.Batch, agent: Agent, plan: gates.Plan) -> bool:
    """Pause the run on the gated calls' approvals and the reconciliations a person decides; False if it cannot.

    The calls a steer kept back wait with them and run after the last decision.
    """
    deps, sid = batch.deps, batch.checkpoint.session_id
    if batch.steered:
        if deps.signals is not None:
            deps.signals.clear_steer(sid)
        batch.steered, batch.steer_deferred = False, True
    approvals = gates.request_approvals(deps, agent, sid, plan.gated, plan.asks)
    return batch.may_start() and batch.pause(
        approvals, plan.decided, [event for ask in plan.asks for event in ask.events]
    )


def run_batch(
    deps: StepDeps, lease: Lease, agent: Agent, checkpoint: Checkpoint, calls: list[ToolCall], live: Live
) -> StepResult:
    """Run the pending calls of the last turn; pause on the ones that need a human.

    A confirmed abort stops the run (``worker.abort``) once the running calls returned.

    Returns:
        The outcome, with the next step's message when every call has a result.
    """
    attempt = machine.attempt_of(checkpoint)
    plan = gates.sort_calls(deps, agent, checkpoint, calls, attempt)
    # The decisions stay on the checkpoint until the turn is complete (machine.record_tool_result).
    batch = batch_state.Batch(
        deps,
        lease,
        checkpoint.model_copy(update={"fingerprint": deps.fingerprint(agent)}),
        unsettled=len(calls),
        live=live,
    )
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
        children = delegation.delegate(batch, agent, plan.tasks, plan.undecided)
        batch.hear()
        if batch.aborting and not batch.fenced:
            batch.closed = True
            return abort.settle(deps, batch.checkpoint, live, None, drained=False)
        if gating and _pause(batch, agent, plan):
            return StepResult(Outcome.PAUSED, also=tuple(children), watch=delegation.watched_children(batch))
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
        return StepResult(outcome, also=tuple(children), watch=delegation.watched_children(batch))
    if batch.checkpoint.pending_tool_calls:
        # The lease was lost before every call ran; the new holder runs the rest.
        return StepResult(Outcome.FENCED)
    crash_point("after_batch_save_before_enqueue", sid)
    return StepResult(
        Outcome.ADVANCED, Next(batch.checkpoint.seq, agent=batch.checkpoint.current_agent), also=tuple(children)
    )
