"""One step of one run: take the lease, claim the fence, load, do one model turn or tool batch, save.

Framework-free: Celery calls ``run_step`` from ``worker.tasks`` and tests call it directly. Every
write is fenced, so a stalled holder's late save is refused and leaves no trace. A step parks a run
only for a condition that will not heal by itself; transient failures and a worker that cannot run
the step during a deploy are retried with backoff for ``retry_for_s``.

Stays whole: one step's path from lease to release, each phase a function, read in order.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import time
from datetime import datetime

from store import errors, inputs, payloads, records, telemetry
from store.records import Checkpoint, LastError, Lease, ToolCall, Usage
from worker import abort, budgets, business, continuation, drift, dynamic, handoffs, machine, retry, slots, subagents
from worker import hooks as hook_calls
from worker import live as live_events
from worker.agents import Agent
from worker.batch import run_batch
from worker.context import Enqueue, Next, Outcome, StepDeps, StepResult, save
from worker.faults import crash_point
from worker.hooks import HookContext, RunEnd
from worker.live import Live
from worker.providers.base import ModelCallCancelled, ModelResponse

__all__ = ["Enqueue", "Outcome", "StepDeps", "run_step"]

log = logging.getLogger("lousho.step")
drift_log = logging.getLogger("lousho.drift")


def run_step(deps: StepDeps, session_id: str, seq: int | None = None) -> Outcome:
    """Perform one step of the run (more with ``deps.continue_steps``); duplicates and late deliveries are harmless.

    With ``continue_steps`` above 1 the task takes the run's next steps itself under the lease it holds, each
    claimed and saved fenced as if it had come through the broker, until ``continuation.next_step`` says stop; the
    last one's follow-up message is sent as usual. Returns the last step's outcome.

    Raises:
        SessionIdInvalidError: the id is not a valid run id (nothing is touched).
    """
    records.validate_session_id(session_id)
    if deps.continue_steps > 1 and telemetry.current() is None:
        # A chain reads what each step loaded and saved from its report: a caller without one gets one here.
        with telemetry.step(session_id, seq):
            return run_step(deps, session_id, seq)
    lease = deps.leases.acquire(session_id)
    if lease is None:
        return Outcome.BUSY
    deps.heartbeat.hold(lease)
    share = continuation.Share(time.monotonic())
    try:
        live = Live(deps.signals, lease)
        with deps.store.pinned():  # one pooled connection for the step's claim, reads and saves
            result = _claim_and_step(deps, lease, session_id, seq, live)
            telemetry.note(outcome=result.outcome.value)
            first = last = telemetry.current()
            taken = 1
            while (follow := continuation.next_step(deps, lease, result, last, taken, share)) is not None:
                _wake(deps, live)
                crash_point("between_chained_steps", session_id)
                result, live, last = _chained_step(deps, lease, session_id, follow, first, last)
                taken += 1
    finally:
        deps.heartbeat.drop(lease)
        try:
            deps.leases.release(lease)
        except errors.StorageError:
            log.warning("could not release lease of %s; it expires by itself", session_id)
    follow_up = result.follow_up
    report = first.last if first is not None else None
    state = report.checkpoint if report is not None else None
    if follow_up is not None:
        # After the release: the next step must find the lease free, or it would be dropped as busy.
        retrying = result.outcome in (Outcome.FAILED, Outcome.HANDED_BACK)
        kind = telemetry.RETRY if retrying or state is None else telemetry.kind_of(state)
        deps.enqueue(
            session_id,
            follow_up.seq,
            follow_up.countdown,
            follow_up.agent,
            name=telemetry.step_name(follow_up.agent, kind),
        )
        crash_point("after_enqueue_before_ack", session_id)
    for other, agent in result.also:
        deps.enqueue(other, None, 0.0, agent, name=telemetry.step_name(agent, telemetry.NEW_INPUT))
    _wake(deps, live)
    if result.watch and _moved_on(deps, result.watch):
        # A child settled while this step held the lease: its wake-up found the run busy and was dropped.
        deps.enqueue(
            session_id,
            None,
            0.0,
            None,
            name=telemetry.step_name(state.current_agent if state is not None else None, telemetry.CHILDREN_SETTLED),
        )
    if live.paused_through and _continued(deps, session_id):
        # A decision continued the run while this step held the lease: its step found the run busy and was dropped.
        deps.enqueue(
            session_id,
            None,
            0.0,
            None,
            name=telemetry.step_name(state.current_agent if state is not None else None, telemetry.RESUME),
        )
    lead = records.lead_of(session_id)
    if lead is not None and result.outcome in _SETTLED:
        # A child that settled wakes its lead (the sweep, if this is lost).
        deps.enqueue(
            lead,
            None,
            0.0,
            None,
            name=telemetry.step_name(state.lead_agent if state is not None else None, telemetry.CHILDREN_SETTLED),
        )
    return result.outcome


def _wake(deps: StepDeps, live: Live) -> None:
    """Send the waiters a step found a model slot kept for (without their step it stays kept until its expiry)."""
    for other, agent in live.woken:
        deps.enqueue(other, None, 0.0, agent, name=telemetry.step_name(agent, telemetry.SLOT_FREED))
    live.woken.clear()


def _chained_step(
    deps: StepDeps,
    lease: Lease,
    session_id: str,
    follow: Next,
    first: telemetry.StepReport | None,
    previous: telemetry.StepReport | None,
) -> tuple[StepResult, Live, telemetry.StepReport]:
    """Take the run's next step in this task, under the lease held: claimed again with the same token.

    Reported on its own, after ``previous`` (``first.chained`` lists it for the task's result).
    """
    state = previous.checkpoint if previous is not None else None
    kind = telemetry.kind_of(state) if state is not None else telemetry.MODEL_TURN
    if previous is not None and not previous.ended_ns:
        previous.ended_ns = time.time_ns()  # the task's first step ends here, not with the task
    task_id = first.task_id if first is not None else None
    with telemetry.step(session_id, follow.seq, task_id=task_id, kind=kind) as report:
        if first is not None:
            first.chained.append(report)
        live = Live(deps.signals, lease)
        result = _claim_and_step(deps, lease, session_id, follow.seq, live, again=True)
        report.outcome = result.outcome.value
        log.debug("chained %s seq=%s -> %s", session_id, follow.seq, result.outcome.value)
    return result, live, report


#: Outcomes after which a child run moves no further by itself: its lead records its result.
_SETTLED = (Outcome.FINISHED, Outcome.PARKED, Outcome.ABORTED, Outcome.PAUSED, Outcome.IDLE)
#: Child states in which a child still moves by itself: it wakes its lead when it leaves them.
_MOVING = ("running", "retrying")


def _continued(deps: StepDeps, session_id: str) -> bool:
    """Whether the run, saved paused by a step that began paused, is in progress again: a decision came meanwhile.

    Read after the lease is released: a decision made later finds the lease free and its own step gets through.
    """
    stored = deps.store.load(session_id)
    return stored is not None and stored.status == "in-progress"


def _moved_on(deps: StepDeps, watch: tuple[tuple[str, str], ...]) -> bool:
    """Whether a child the run waits on left the state the step found it in for one it stays in (settled, paused).

    Read after the lease is released: a child that settles later finds the lease free and its own wake-up gets
    through, so between the two the run is always woken. A child still paused as the step found it is not news
    (the run stays paused on it; waking it would loop).
    """
    for child, seen in watch:
        now = subagents.state_of(deps.store.load(child))
        if now not in _MOVING and now != seen:
            return True
    return False


def _claim_and_step(
    deps: StepDeps, lease: Lease, session_id: str, seq: int | None, live: Live, *, again: bool = False
) -> StepResult:
    """Under the lease: claim the fence and load the run, then take its step unless the message is stale.

    ``again``: the task claims its run once more for a step it chains (same token).
    """
    crash_point("after_lease_before_epoch", session_id)
    try:
        claim = deps.store.claim(session_id, lease.token, seq, again=again)
    except errors.CheckpointCorruptError as exc:
        # The fence was claimed before the document failed to parse: park the run under it.
        deps.store.record_failure(session_id, lease.token, LastError(**exc.to_record()))
        return StepResult(Outcome.PARKED)
    except errors.CheckpointFormatError as exc:
        # Written by a newer release: a worker of that release reads it (the fence is ours).
        return retry.hand_back_unreadable(deps, session_id, lease.token, exc)
    if claim.checkpoint is None:
        if claim.stored_fence is None:
            return StepResult(Outcome.UNKNOWN)
        # The Redis counter is behind Postgres (Redis lost its keys): mint a token above it.
        if not deps.leases.raise_token(lease, claim.stored_fence):
            return StepResult(Outcome.BUSY)
        claim = deps.store.claim(session_id, lease.token, seq)
        if claim.checkpoint is None:
            return StepResult(Outcome.BUSY)
    checkpoint = claim.checkpoint
    telemetry.note(
        agent=checkpoint.current_agent,
        kind=telemetry.kind_of(checkpoint),
        trace=checkpoint.trace,
        checkpoint=checkpoint,
    )
    _forget_stale_signals(deps, lease, claim)
    if (
        claim.lead_gone
        and checkpoint.status != "finished"
        and not (checkpoint.last_error is not None and not checkpoint.last_error.retryable)
    ):
        # A sub-agent whose lead was deleted: nothing would read its result, so it stops before any model call
        # or tool (and retention prunes it once it is old enough).
        gone = errors.LeadGoneError(f"the lead of run {session_id!r} is gone; this sub-agent run stops here")
        return retry.park(deps, checkpoint, LastError(**gone.to_record()))
    base = deps.agents.get(checkpoint.agent)
    live.claimed(claim.now, base is not None and bool(hook_calls.having(base.hooks, "on_run_end")))
    if claim.abort_requested and checkpoint.status != "finished":
        result = abort.settle(deps, checkpoint, live, None, drained=False)
    elif seq is not None and checkpoint.seq != seq:
        return StepResult(Outcome.STALE)
    else:
        result = _step(deps, lease, checkpoint, claim.inbox_head, claim.now, live)
    ended = live.end_owed
    if ended is not None and base is not None:
        _end_hooks(deps, base, ended, claim.now)
    return result


def _end_hooks(deps: StepDeps, agent: Agent, checkpoint: Checkpoint, now: datetime | None) -> Checkpoint:
    """Run the ``on_run_end`` hooks owed since ``checkpoint`` was saved, then note that they ran.

    At least once: a crash before the note leaves ``end_due`` set, and the next step of the run (the sweep
    sends one) runs them again with the same ``end_id``. A hook that raises parks the run (``resume()``
    runs them again).
    """
    hooks = hook_calls.having(agent.hooks, "on_run_end")
    sid = checkpoint.session_id
    end = RunEnd(
        end_id=f"{sid}:{checkpoint.seq}",
        session_id=sid,
        agent=agent.name,
        status=checkpoint.status,
        finish_reason=checkpoint.finish_reason
        or ("awaiting-approval" if checkpoint.status == "awaiting-approval" else None),
        text=checkpoint.final_text,
        steps=checkpoint.step,
        usage=checkpoint.usage,
        approval_ids=tuple(checkpoint.approval_ids),
    )
    ctx = business.read_only(
        HookContext(
            session_id=sid,
            agent=agent.name,
            step=checkpoint.step,
            metadata=checkpoint.metadata,
            business_state=business.handed(checkpoint.business_state),
        )
    )
    try:
        hook_calls.on_run_end(hooks, ctx, end)
    except errors.HookFailedError as exc:
        retry.record_failure(deps, checkpoint, exc, now)
        return checkpoint
    crash_point("after_end_hooks_before_note", sid)
    deps.store.settle_end(sid, checkpoint.fence, checkpoint.seq)
    return checkpoint.model_copy(update={"end_due": False})


def _forget_stale_signals(deps: StepDeps, lease: Lease, claim: records.Claim) -> None:
    """Silence signals the claim shows are stale, so they never cut this step short."""
    if lease.abort.is_set() and not claim.abort_requested:
        # A doorbell left from an abort that was settled already.
        lease.abort.clear()
        if deps.signals is not None:
            deps.signals.clear_abort(lease.session_id)
    if lease.steer > claim.inbox_head:
        # A steer mark for input this run does not have (a run deleted and made again).
        lease.steer = 0
        if deps.signals is not None:
            deps.signals.clear_steer(lease.session_id)


def _step(
    deps: StepDeps, lease: Lease, checkpoint: Checkpoint, inbox_head: int, now: datetime | None, live: Live
) -> StepResult:
    if checkpoint.last_error is not None and not checkpoint.last_error.retryable:
        return StepResult(Outcome.IDLE)
    if checkpoint.attempts > deps.max_attempts:
        exceeded = errors.StepAttemptsExceededError(
            f"step started {checkpoint.attempts} times without finishing (the worker died each time); run parked"
        )
        return retry.park(deps, checkpoint, LastError(**exceeded.to_record()))
    agent = handoffs.agent_for(checkpoint, deps.agents)
    if agent is None:
        return retry.hand_back_agent(deps, checkpoint, now)
    agent = subagents.inheriting(agent, checkpoint, deps.agents)
    planned = _plan(deps, agent, checkpoint, inbox_head, now, live)
    if isinstance(planned, StepResult):
        return planned
    agent, action = planned
    try:
        if isinstance(action, machine.ModelTurn | machine.ToolBatch):
            refused = _stop_if_refused(deps, agent, checkpoint, action, now, live)
            if refused is not None:
                return refused
        if isinstance(action, machine.Save):
            return _save_only(deps, agent, action, checkpoint.status, live)
        if isinstance(action, machine.ModelTurn):
            return _model_turn(deps, agent, action, lease, live, checkpoint.status)
        return run_batch(deps, lease, agent, action.checkpoint, action.calls, live)
    except errors.FencedOutError:
        return StepResult(Outcome.FENCED)
    except Exception as exc:  # classified and recorded below, never swallowed
        return _fail(deps, checkpoint, action, exc, now, live)


def _plan(
    deps: StepDeps, agent: Agent, checkpoint: Checkpoint, inbox_head: int, now: datetime | None, live: Live
) -> tuple[Agent, machine.ModelTurn | machine.ToolBatch | machine.Save] | StepResult:
    """The agent that runs the step (a dynamic agent's choice) and what it does, or the step's result already.

    ``on_run_end`` hooks an earlier save owes run first; input that would not fit once merged parks the run.
    """
    if checkpoint.end_due:
        checkpoint = _end_hooks(deps, agent, checkpoint, now)
        if checkpoint.end_due:
            return StepResult(Outcome.PARKED)
    inbox = []
    if inbox_head > checkpoint.inbox_cursor:
        inbox = deps.store.inbox(checkpoint.session_id, checkpoint.inbox_cursor)
    try:
        agent, chose = dynamic.for_run(agent, checkpoint, inbox)
        limits = budgets.limits_of(agent, checkpoint)
    except errors.LoushoError as exc:
        return retry.record_failure(deps, checkpoint, exc, now)
    in_flight = (lambda: subagents.in_flight(deps.store, checkpoint)) if checkpoint.background else None
    action = machine.plan(
        checkpoint,
        inbox,
        instructions=agent.instructions,
        max_steps=agent.max_steps,
        over_budget=budgets.checker(limits, agent.prices, live.db_now(), in_flight),
    )
    if isinstance(action, machine.Idle):
        return StepResult(Outcome.IDLE)
    if (
        isinstance(action, machine.ModelTurn | machine.Save)
        and action.drained_inbox
        and action.checkpoint.business_state != checkpoint.business_state
    ):
        # Saved with the merged input, by whichever save of this step makes it durable.
        live.pending.append(business.sent(action.checkpoint.business_state, action.checkpoint.inbox_cursor))
    if chose and isinstance(action, machine.ModelTurn | machine.Save):
        action = dataclasses.replace(action, checkpoint=dynamic.chosen(action.checkpoint, agent))
    if limits is not None and limits.max_duration_s is not None and not isinstance(action, machine.Save):
        action = dataclasses.replace(action, checkpoint=budgets.clock_running(action.checkpoint, live.db_now()))
    if isinstance(action, machine.ModelTurn | machine.Save) and action.drained_inbox:
        unmergeable = _too_large_to_merge(action.checkpoint)
        if unmergeable is not None:
            # Before the model call: a turn on input that cannot be saved is paid for and then lost, on every
            # resume and every later send alike. Parked, the input stays queued for a fork to take over.
            return retry.park(deps, checkpoint, LastError(**unmergeable.to_record()))
    return agent, action


def _too_large_to_merge(merged: Checkpoint) -> errors.InputTooLargeError | None:
    """The refusal of the input merged into ``merged`` when it leaves no room for a reply; None when it fits.

    Measured once per merged input (a step that merges nothing pays nothing here).
    """
    size = len(payloads.dumps(merged.document()).encode("utf-8"))
    return None if inputs.leaves_room(size) else inputs.no_room(merged.session_id, size, queued=True)


def _fail(
    deps: StepDeps, checkpoint: Checkpoint, action: machine.Action, exc: Exception, now: datetime | None, live: Live
) -> StepResult:
    """Record why the step failed, after keeping the input it had merged."""
    try:
        checkpoint = _keep_input(deps, checkpoint, action, live)
    except errors.FencedOutError:
        return StepResult(Outcome.FENCED)
    except errors.LoushoError as unkept:  # the merged input itself cannot be saved (too large, say)
        return retry.record_failure(deps, checkpoint, unkept, now)
    return retry.record_failure(deps, checkpoint, exc, now)


def _keep_input(deps: StepDeps, checkpoint: Checkpoint, action: machine.Action, live: Live) -> Checkpoint:
    """Before a failure is recorded: make the input this step merged durable, with nothing else.

    A follow-up to a finished run must not leave the run looking finished with a failure nobody
    lists; saved like this, the run is in progress with the input in its transcript, listed by
    ``pending()``, and a resume or a later send carries on from here (the input is never applied twice).
    The events the merge made true (a business state sent with the input) are saved with it.
    """
    if isinstance(action, machine.ModelTurn) and action.drained_inbox:
        kept = save(
            deps, action.checkpoint, drained_inbox=True, status_before=checkpoint.status, events=tuple(live.pending)
        )
        live.pending.clear()
        return kept
    return checkpoint


def _check_resume(
    deps: StepDeps, agent: Agent, checkpoint: Checkpoint, action: machine.ModelTurn | machine.ToolBatch, live: Live
) -> errors.LoushoError | None:
    """Before any model call or tool runs: is the agent still the one that saved the run?"""
    saved_tools = (checkpoint.fingerprint or {}).get("tools") or {}
    if isinstance(action, machine.ToolBatch):
        missing = sorted({c.name for c in action.calls if c.name not in agent.tools and c.name in saved_tools})
        if missing:
            return errors.ResumeToolMissingError(
                f"pending calls of run {checkpoint.session_id!r} use tools agent {agent.name!r} no longer has:"
                f" {', '.join(missing)}"
            )
    found = drift.compare(checkpoint.fingerprint, deps.fingerprint(agent))
    if found is None or agent.on_agent_drift == "ignore":
        return None
    if agent.on_agent_drift == "error":
        return errors.AgentDriftError(
            f"agent {agent.name!r} changed since run {checkpoint.session_id!r} was saved: {found.describe()}"
        )
    drift_log.warning(
        "agent %s changed under run %s: %s",
        agent.name,
        checkpoint.session_id,
        found.describe(),
        extra={"lousho_event": "agent.drift", "drift": found.as_event()},
    )
    live.pending.append(live_events.drift(found.as_event()))
    return None


def _stop_if_refused(
    deps: StepDeps,
    agent: Agent,
    checkpoint: Checkpoint,
    action: machine.ModelTurn | machine.ToolBatch,
    now: datetime | None,
    live: Live,
) -> StepResult | None:
    """Stop when ``agent`` cannot resume the run: hand the step back while a live worker can, else refuse.

    None lets the step go on.
    """
    refusal = _check_resume(deps, agent, checkpoint, action, live)
    if refusal is None:
        return None
    if _runs_elsewhere(deps, checkpoint, action, refusal):
        return retry.retry_later(deps, checkpoint, LastError(**refusal.to_record()), None, now, handing_back=True)
    return StepResult(_refuse(deps, _keep_input(deps, checkpoint, action, live), refusal))


def _refuse(deps: StepDeps, checkpoint: Checkpoint, error: errors.LoushoError) -> Outcome:
    """Stop without touching the checkpoint; decisions the run was about to act on are put back."""
    last_error = LastError(**error.to_record())
    deps.store.refuse(
        checkpoint.session_id,
        checkpoint.fence,
        last_error,
        checkpoint.approval_ids,
        [live_events.error(last_error), live_events.run_done(checkpoint, "error")],
    )
    log.warning("run %s refused: %s", checkpoint.session_id, error.code)
    return Outcome.PARKED


def _save_only(deps: StepDeps, agent: Agent, action: machine.Save, status_before: str, live: Live) -> StepResult:
    checkpoint, cancel = _background_at_end(deps, agent, action.checkpoint)
    if checkpoint.waiting and status_before == "in-progress" and action.checkpoint.waiting:
        return StepResult(Outcome.IDLE)  # its answer is saved; it still waits on background tasks
    checkpoint = checkpoint.model_copy(update={"fingerprint": deps.fingerprint(agent)})
    saved = save(deps, checkpoint, drained_inbox=action.drained_inbox, status_before=status_before, live=live)
    return StepResult(Outcome.FINISHED if saved.status == "finished" else Outcome.IDLE, also=_cancel(deps, cancel))


def _background_at_end(deps: StepDeps, agent: Agent, checkpoint: Checkpoint) -> tuple[Checkpoint, list[str]]:
    """A finishing checkpoint with background tasks still running: kept waiting on them, or with them to cancel.

    ``background_on_finish="await"``: the run's answer is saved but the run stays in progress, waiting, until they
    settled (each wakes it). ``"cancel"``: it finishes, and the running ones are returned to be stopped.
    """
    if checkpoint.status != "finished" or not checkpoint.background:
        return checkpoint, []
    still = subagents.running([deps.store.load(child) for child in checkpoint.background])
    if not still:
        return checkpoint.model_copy(update={"waiting": False}), []
    if agent.background_on_finish == "await":
        return checkpoint.model_copy(update={"status": "in-progress", "finish_reason": None, "waiting": True}), []
    return checkpoint.model_copy(update={"waiting": False}), still


def _cancel(deps: StepDeps, children: list[str]) -> tuple[tuple[str, str | None], ...]:
    """Ask each background task in ``children`` to stop; the steps that settle it, to send."""
    for child in children:
        deps.store.request_abort(child)
    return tuple((child, None) for child in children)


@functools.cache
def _takes_listener(model_type: type) -> bool:
    """Whether a model class's ``generate`` accepts a ``listener`` (it can stream)."""
    try:
        return "listener" in inspect.signature(model_type.generate).parameters  # type: ignore[attr-defined]
    except (TypeError, ValueError, AttributeError):
        return False


def _generate(agent: Agent, checkpoint: Checkpoint, live: Live) -> tuple[ModelResponse | None, business.Write | None]:
    """Call the model in the step's thread; None when a listening model stopped on ``live.cancelled``.

    ``pre_generate`` hooks shape the request (a copy: the saved transcript stays as it is) and
    ``post_generate`` hooks see the answer. The model streams to ``live`` only while someone watches the run.
    Also returns the business state the hooks wrote (saved with the turn; dropped with it).

    Raises:
        HookFailedError: a hook raised, or wrote a business state that cannot be saved.
    """
    live.cursor = checkpoint.inbox_cursor
    model = agent.model
    assert model is not None  # a dynamic agent's model is chosen before its step runs (worker.dynamic)
    messages, tools = handoffs.instructed(list(checkpoint.messages), agent, checkpoint), agent.tool_specs()
    hooks = agent.hooks
    ctx = (
        HookContext(
            session_id=checkpoint.session_id,
            agent=agent.name,
            step=checkpoint.step,
            metadata=checkpoint.metadata,
            business_state=business.handed(checkpoint.business_state),
        )
        if hooks
        else None
    )
    if ctx is not None and hook_calls.having(hooks, "pre_generate"):
        request = hook_calls.pre_generate(
            hook_calls.having(hooks, "pre_generate"), ctx, hook_calls.ModelRequest(messages, list(tools))
        )
        messages, tools = list(request.messages), list(request.tools)
    streams = live.watched and _takes_listener(type(model))
    model_id = str(getattr(model, "model_id", None) or type(model).__name__)
    started = time.time_ns()
    try:
        if streams:
            response = model.generate(messages, tools, listener=live)  # type: ignore[call-arg]
        else:
            response = model.generate(messages, tools)
    except ModelCallCancelled:
        telemetry.model_call(model_id, started, error="cancelled")
        return None, None
    except Exception as exc:
        telemetry.model_call(model_id, started, error=getattr(exc, "code", None) or type(exc).__name__)
        raise
    telemetry.model_call(
        model_id,
        started,
        input_tokens=response.usage.input_tokens,
        output_tokens=response.usage.output_tokens,
        finish_reason=response.finish_reason,
    )
    if ctx is not None and hook_calls.having(hooks, "post_generate"):
        hook_calls.post_generate(hook_calls.having(hooks, "post_generate"), ctx, response)
    return response, business.hook_written(checkpoint.business_state, ctx) if ctx is not None else None


def _cut_short(deps: StepDeps, lease: Lease, checkpoint: Checkpoint, live: Live) -> str | None:
    """Why the model's answer is dropped, if it is.

    ``"abort"`` (confirmed in Postgres), ``"steer"`` (nothing was emitted before a steer came), or None.
    """
    if abort.confirmed(deps, lease):
        return "abort"
    if lease.steer > checkpoint.inbox_cursor and not live.emitted:
        return "steer"
    return None


def _take_slot(deps: StepDeps, agent: Agent, checkpoint: Checkpoint, live: Live) -> slots.Held | StepResult | None:
    """A slot of the agent's ``ModelLimit`` for this model call; the step's waiting result when there is none.

    None when the agent has no limit. A wait is no failure and no attempt: the claim's count is taken back and the
    run comes back by a countdown (a timed wait) or by a wake-up when a slot is kept for it.

    Raises:
        FencedOutError: another holder took the run over.
        StorageError: the limits cannot be read (recorded as a retryable failure).
    """
    limit = slots.limit_of(agent, deps.model_limits)
    if limit is None or deps.slots is None:
        return None
    sid = checkpoint.session_id
    fairness, weight = slots.fairness_of(checkpoint, deps.fairness_weights)
    answer = deps.slots.acquire(limit, sid, checkpoint.current_agent, fairness, weight)
    live.woken.extend(slots.woken_names(answer.woken))
    telemetry.note(limit_key=limit.key)
    if answer.granted:
        held = slots.Held(limit, sid)
        if deps.slot_keeper is not None:
            deps.slot_keeper.hold(held)
        return held
    slots.noted(limit, answer)
    return _wait(deps, checkpoint, slots.wait_countdown(answer, retry.COUNTDOWN_MAX_S))


def _wait(deps: StepDeps, checkpoint: Checkpoint, countdown: float | None) -> StepResult:
    """End the step as waiting on a model limit, back in ``countdown`` seconds (None: when woken)."""
    if not deps.store.note_wait(checkpoint.session_id, checkpoint.fence):
        raise errors.FencedOutError(checkpoint.session_id, checkpoint.fence)
    follow_up = None if countdown is None else Next(checkpoint.seq, countdown, checkpoint.current_agent)
    return StepResult(Outcome.WAITING, follow_up)


def _give_back(
    deps: StepDeps, held: slots.Held | None, live: Live, tokens: int = 0, failed: BaseException | None = None
) -> float | None:
    """Release the call's slot, counting the ``tokens`` it reported; the key's cool-down when ``failed`` asks one."""
    if held is None or deps.slots is None:
        return None
    if deps.slot_keeper is not None:
        deps.slot_keeper.drop(held)
    cool = slots.cool_down_of(failed) if failed is not None else None
    try:
        if cool is not None:
            deps.slots.cool_down(held.limit.key, cool)
        live.woken.extend(slots.woken_names(deps.slots.release(held.limit, held.session_id, tokens)))
    except errors.StorageError:
        log.warning("could not give back the model slot of %s; it expires by itself", held.session_id)
    return cool


def _limited_generate(
    deps: StepDeps, agent: Agent, checkpoint: Checkpoint, live: Live
) -> tuple[ModelResponse | None, business.Write | None] | StepResult:
    """``_generate`` under the agent's model limit: the answer, or the step's result when the run must wait."""
    held = _take_slot(deps, agent, checkpoint, live)
    if isinstance(held, StepResult):
        return held
    crash_point("during_model_call", checkpoint.session_id)
    live.emit("step.start", {"step": checkpoint.step + 1})
    try:
        response, write = _generate(agent, checkpoint, live)
    except Exception as exc:  # the slot goes back whatever happened; the error is the step's to classify
        cool = _give_back(deps, held, live, failed=exc)
        if cool is None:
            raise
        # Every caller of the key now waits the provider's Retry-After out; this one too, as a wait, not a failure.
        telemetry.note(waited="cool-down", cooled=True)
        return _wait(deps, checkpoint, min(cool, retry.COUNTDOWN_MAX_S))
    _give_back(deps, held, live, response.usage.total_tokens if response is not None else 0)
    return response, write


def _model_turn(
    deps: StepDeps, agent: Agent, action: machine.ModelTurn, lease: Lease, live: Live, status_before: str
) -> StepResult:
    checkpoint = action.checkpoint
    sid = checkpoint.session_id
    started = time.perf_counter()
    generated = _limited_generate(deps, agent, checkpoint, live)
    if isinstance(generated, StepResult):
        return generated
    response, write = generated
    log.debug("model turn of %s took %.1f ms", sid, (time.perf_counter() - started) * 1000)
    if response is not None and getattr(agent.model, "reports_usage", True) and response.usage.total_tokens:
        # Billed usage must survive a crash before the save (the turn is then generated again).
        pending = (checkpoint.uncounted_usage or Usage()) + response.usage
        if not deps.store.note_usage(sid, checkpoint.fence, pending):
            raise errors.FencedOutError(sid, checkpoint.fence)
    stop = _cut_short(deps, lease, checkpoint, live)
    if stop == "abort":
        billed = checkpoint.usage + response.usage if response is not None else checkpoint.usage
        return abort.settle(
            deps, checkpoint.model_copy(update={"usage": billed}), live, [], drained=action.drained_inbox
        )
    if stop is not None or response is None:
        # Steered before the model said anything: ask again, with the new message (its usage is kept as
        # uncounted until the next save).
        log.info("model call of %s cut short by a steer", sid)
        return StepResult(Outcome.ADVANCED, Next(checkpoint.seq, agent=checkpoint.current_agent))
    calls = response.tool_calls
    overflow: list[ToolCall] = []
    if len(calls) > payloads.MAX_TOOL_CALLS_PER_TURN:
        calls, overflow = calls[: payloads.MAX_TOOL_CALLS_PER_TURN], calls[payloads.MAX_TOOL_CALLS_PER_TURN :]
    crash_point("after_model_response_before_save", sid)
    updated = machine.apply_model_response(
        checkpoint, response.text, calls + overflow, response.usage, response.finish_reason
    )
    for call in overflow:
        updated = machine.record_tool_result(
            updated,
            machine.tool_error(
                call, "not-run", "TooManyToolCalls", f"only {payloads.MAX_TOOL_CALLS_PER_TURN} tool calls run per turn"
            ),
        )
    updated = updated.model_copy(update={"fingerprint": deps.fingerprint(agent)})
    if write is not None:
        updated = updated.model_copy(update={"business_state": write.value})
    telemetry.note(calls_asked=len(calls) + len(overflow))
    updated, cancel = _background_at_end(deps, agent, updated)
    # The model's answer is durable before any of its tools runs: a crash never regenerates it.
    turn = updated.messages[len(checkpoint.messages)]
    cost = agent.prices.cost(response.usage) if agent.prices is not None else None
    events = [live_events.step_done(updated.step, turn, response.usage, (time.perf_counter() - started) * 1000, cost)]
    if write is not None:
        events.append(business.changed(write, step=updated.step))
    saved = save(
        deps, updated, drained_inbox=action.drained_inbox, events=events, status_before=status_before, live=live
    )
    crash_point("after_model_save_before_enqueue", sid)
    if saved.status == "finished":
        return StepResult(Outcome.FINISHED, also=_cancel(deps, cancel))
    if saved.waiting:
        # Answered; waits on its background tasks (found running just now).
        return StepResult(Outcome.DELEGATED, watch=tuple((child, "running") for child in saved.background or ()))
    return StepResult(Outcome.ADVANCED, Next(saved.seq, agent=checkpoint.current_agent))


def _runs_elsewhere(
    deps: StepDeps, checkpoint: Checkpoint, action: machine.ModelTurn | machine.ToolBatch, refusal: errors.LoushoError
) -> bool:
    """Whether another live worker has what this one lacks to resume the run (a deploy under way).

    That is the tools of the pending calls, or exactly the agent the run was saved with.
    """
    if isinstance(refusal, errors.ResumeToolMissingError) and isinstance(action, machine.ToolBatch):
        names = {call.name for call in action.calls}
        return any(serving.has_tools(names) for serving in deps.serving(checkpoint.current_agent))
    if isinstance(refusal, errors.AgentDriftError) and checkpoint.fingerprint is not None:
        return any(serving.fingerprint == checkpoint.fingerprint for serving in deps.serving(checkpoint.current_agent))
    return False
