"""One step of one run: take the lease, claim the fence, load, do one model turn or tool batch, save.

Framework-free: Celery calls ``run_step`` from ``worker.tasks`` and tests call it directly. Every
write is fenced, so a stalled holder's late save is refused and leaves no trace. A step parks a run
only for a condition that will not heal by itself; transient failures and a worker that cannot run
the step during a deploy are retried with backoff for ``retry_for_s``.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from datetime import datetime

import redis

from store import errors, payloads, records
from store.leases import Lease
from store.records import Checkpoint, LastError, ToolCall, Usage
from worker import drift, machine
from worker.agents import Agent
from worker.batch import run_batch
from worker.context import Enqueue, Next, Outcome, StepDeps, save
from worker.faults import crash_point

__all__ = ["Enqueue", "Outcome", "StepDeps", "run_step"]

#: The longest wait sent as a Celery countdown; longer waits are kept in Postgres (``next_attempt_at``)
#: and honoured by the recovery sweep, since delayed messages age in the broker (RELIABILITY P1).
COUNTDOWN_MAX_S = 5.0

log = logging.getLogger("lousho.step")
drift_log = logging.getLogger("lousho.drift")


def run_step(deps: StepDeps, session_id: str, seq: int | None = None) -> Outcome:
    """Perform at most one step of the run; duplicates and late deliveries are harmless.

    Raises:
        SessionIdInvalidError: the id is not a valid run id (nothing is touched).
    """
    records.validate_session_id(session_id)
    lease = deps.leases.acquire(session_id)
    if lease is None:
        return Outcome.BUSY
    deps.heartbeat.hold(lease)
    after = Next()
    try:
        crash_point("after_lease_before_epoch", session_id)
        try:
            claim = deps.store.claim(session_id, lease.token, seq)
        except errors.CheckpointCorruptError as exc:
            # The fence was claimed before the document failed to parse: park the run under it.
            deps.store.record_failure(session_id, lease.token, LastError(**exc.to_record()))
            return Outcome.PARKED
        except errors.CheckpointFormatError as exc:
            # Written by a newer release: a worker of that release reads it (the fence is ours).
            return _hand_back_unreadable(deps, session_id, lease.token, exc, after)
        if claim.checkpoint is None:
            if claim.stored_fence is None:
                return Outcome.UNKNOWN
            # The Redis counter is behind Postgres (Redis lost its keys): mint a token above it.
            if not deps.leases.raise_token(lease, claim.stored_fence):
                return Outcome.BUSY
            claim = deps.store.claim(session_id, lease.token, seq)
            if claim.checkpoint is None:
                return Outcome.BUSY
        checkpoint = claim.checkpoint
        if seq is not None and checkpoint.seq != seq:
            return Outcome.STALE
        after.agent = checkpoint.agent
        outcome = _step(deps, lease, checkpoint, claim.inbox_head, after, claim.now)
    finally:
        deps.heartbeat.drop(lease)
        try:
            deps.leases.release(lease)
        except redis.RedisError:
            log.warning("could not release lease of %s; it expires by itself", session_id)
    if after.seq is not None:
        # After the release: the next step must find the lease free, or it would be dropped as busy.
        deps.enqueue(session_id, after.seq, after.countdown, after.agent)
        crash_point("after_enqueue_before_ack", session_id)
    return outcome


def _step(deps: StepDeps, lease: Lease, checkpoint: Checkpoint, inbox_head: int, after: Next,
          now: datetime | None) -> Outcome:
    if checkpoint.last_error is not None and not checkpoint.last_error.retryable:
        return Outcome.IDLE
    if checkpoint.attempts > deps.max_attempts:
        exceeded = errors.StepAttemptsExceededError(
            f"step started {checkpoint.attempts} times without finishing (the worker died each time); run parked")
        return _park(deps, checkpoint, LastError(**exceeded.to_record()))
    agent = deps.agents.get(checkpoint.agent)
    if agent is None:
        return _hand_back_agent(deps, checkpoint, after, now)
    inbox = []
    if inbox_head > checkpoint.inbox_cursor:
        inbox = deps.store.inbox(checkpoint.session_id, checkpoint.inbox_cursor)
    action = machine.plan(checkpoint, inbox, instructions=agent.instructions, max_steps=agent.max_steps)
    if isinstance(action, machine.Idle):
        return Outcome.IDLE
    try:
        if isinstance(action, machine.ModelTurn | machine.ToolBatch):
            refusal = _check_resume(deps, agent, checkpoint, action)
            if refusal is not None:
                if _runs_elsewhere(deps, checkpoint, action, refusal):
                    return _retry(deps, checkpoint, LastError(**refusal.to_record()), None, after, now,
                                  handing_back=True)
                return _refuse(deps, _keep_input(deps, checkpoint, action), refusal)
        if isinstance(action, machine.Save):
            return _save_only(deps, agent, action)
        if isinstance(action, machine.ModelTurn):
            return _model_turn(deps, agent, action, after)
        return run_batch(deps, lease, agent, action.checkpoint, action.calls, after)
    except errors.FencedOutError:
        return Outcome.FENCED
    except Exception as exc:  # classified and recorded below, never swallowed
        return _fail(deps, checkpoint, action, exc, after, now)


def _fail(deps: StepDeps, checkpoint: Checkpoint, action: machine.Action, exc: Exception, after: Next,
          now: datetime | None) -> Outcome:
    """Record why the step failed, after keeping the input it had merged."""
    try:
        checkpoint = _keep_input(deps, checkpoint, action)
    except errors.FencedOutError:
        return Outcome.FENCED
    except errors.LoushoError as unkept:  # the merged input itself cannot be saved (too large, say)
        return _record_failure(deps, checkpoint, unkept, after, now)
    return _record_failure(deps, checkpoint, exc, after, now)


def _keep_input(deps: StepDeps, checkpoint: Checkpoint, action: machine.Action) -> Checkpoint:
    """Before a failure is recorded: make the input this step merged durable, with nothing else.

    A follow-up to a finished run must not leave the run looking finished with a failure nobody
    lists; saved like this, the run is in progress with the input in its transcript, listed by
    ``pending()``, and a resume or a later send carries on from here (the input is never applied twice).
    """
    if isinstance(action, machine.ModelTurn) and action.drained_inbox:
        return save(deps, action.checkpoint, drained_inbox=True)
    return checkpoint


def _check_resume(deps: StepDeps, agent: Agent, checkpoint: Checkpoint,
                  action: machine.ModelTurn | machine.ToolBatch) -> errors.LoushoError | None:
    """Before any model call or tool runs: is the agent still the one that saved the run?"""
    saved_tools = (checkpoint.fingerprint or {}).get("tools") or {}
    if isinstance(action, machine.ToolBatch):
        missing = sorted({c.name for c in action.calls if c.name not in agent.tools and c.name in saved_tools})
        if missing:
            return errors.ResumeToolMissingError(
                f"pending calls of run {checkpoint.session_id!r} use tools agent {agent.name!r} no longer has:"
                f" {', '.join(missing)}")
    found = drift.compare(checkpoint.fingerprint, deps.fingerprint(agent))
    if found is None or agent.on_agent_drift == "ignore":
        return None
    if agent.on_agent_drift == "error":
        return errors.AgentDriftError(
            f"agent {agent.name!r} changed since run {checkpoint.session_id!r} was saved: {found.describe()}")
    drift_log.warning("agent %s changed under run %s: %s", agent.name, checkpoint.session_id, found.describe(),
                      extra={"lousho_event": "agent.drift", "drift": found.as_event()})
    return None


def _refuse(deps: StepDeps, checkpoint: Checkpoint, error: errors.LoushoError) -> Outcome:
    """Stop without touching the checkpoint; decisions the run was about to act on are put back."""
    deps.store.refuse(checkpoint.session_id, checkpoint.fence, LastError(**error.to_record()),
                      checkpoint.approval_ids)
    log.warning("run %s refused: %s", checkpoint.session_id, error.code)
    return Outcome.PARKED


def _save_only(deps: StepDeps, agent: Agent, action: machine.Save) -> Outcome:
    checkpoint = action.checkpoint.model_copy(update={"fingerprint": deps.fingerprint(agent)})
    saved = save(deps, checkpoint, drained_inbox=action.drained_inbox)
    return Outcome.FINISHED if saved.status == "finished" else Outcome.IDLE


def _model_turn(deps: StepDeps, agent: Agent, action: machine.ModelTurn, after: Next) -> Outcome:
    checkpoint = action.checkpoint
    sid = checkpoint.session_id
    crash_point("during_model_call", sid)
    started = time.perf_counter()
    response = agent.model.generate(list(checkpoint.messages), agent.tool_specs())
    log.debug("model turn of %s took %.1f ms", sid, (time.perf_counter() - started) * 1000)
    if getattr(agent.model, "reports_usage", True) and response.usage.total_tokens:
        # Billed usage must survive a crash before the save (the turn is then generated again).
        pending = (checkpoint.uncounted_usage or Usage()) + response.usage
        if not deps.store.note_usage(sid, checkpoint.fence, pending):
            raise errors.FencedOutError(sid, checkpoint.fence)
    calls = response.tool_calls
    overflow: list[ToolCall] = []
    if len(calls) > payloads.MAX_TOOL_CALLS_PER_TURN:
        calls, overflow = calls[:payloads.MAX_TOOL_CALLS_PER_TURN], calls[payloads.MAX_TOOL_CALLS_PER_TURN:]
    crash_point("after_model_response_before_save", sid)
    updated = machine.apply_model_response(checkpoint, response.text, calls + overflow, response.usage)
    for call in overflow:
        updated = machine.record_tool_result(updated, machine.tool_error(
            call, "not-run", "TooManyToolCalls", f"only {payloads.MAX_TOOL_CALLS_PER_TURN} tool calls run per turn"))
    updated = updated.model_copy(update={"fingerprint": deps.fingerprint(agent)})
    # The model's answer is durable before any of its tools runs: a crash never regenerates it.
    saved = save(deps, updated, drained_inbox=action.drained_inbox)
    crash_point("after_model_save_before_enqueue", sid)
    if saved.status == "finished":
        return Outcome.FINISHED
    after.seq = saved.seq
    return Outcome.ADVANCED


def _park(deps: StepDeps, checkpoint: Checkpoint, error: LastError) -> Outcome:
    deps.store.record_failure(checkpoint.session_id, checkpoint.fence, error.model_copy(update={"retryable": False}))
    log.warning("run %s parked: %s", checkpoint.session_id, error.code)
    return Outcome.PARKED


def _record_failure(deps: StepDeps, checkpoint: Checkpoint, exc: Exception, after: Next,
                    now: datetime | None) -> Outcome:
    # Messages can quote a provider's response or a key: cleaned and masked before they are stored.
    if isinstance(exc, errors.LoushoError):
        error = LastError(code=exc.code, message=payloads.clean_error(exc.message), retryable=exc.retryable)
    else:
        error = LastError(code="LOUSHO_AGENT_EXECUTION_FAILED",
                          message=payloads.clean_error(f"{type(exc).__name__}: {str(exc)[:1000]}"), retryable=True)
    if not error.retryable:
        if deps.store.record_failure(checkpoint.session_id, checkpoint.fence, error) is None:
            return Outcome.FENCED
        log.warning("step of %s failed: %s (not retryable; run parked)", checkpoint.session_id, error.code)
        return Outcome.PARKED
    return _retry(deps, checkpoint, error, getattr(exc, "retry_after", None), after, now)


def _retry(deps: StepDeps, checkpoint: Checkpoint, error: LastError, retry_after: float | None, after: Next,
           now: datetime | None, *, handing_back: bool = False,
           served_elsewhere: Callable[[], bool] | None = None) -> Outcome:
    """Record a transient failure and schedule the next attempt, or park once the retry budget is spent.

    Waits up to ``COUNTDOWN_MAX_S`` go out as a countdown message; longer ones wait in Postgres
    for the sweep. While ``served_elsewhere`` says a live worker can run the step, the budget
    does not park the run.
    """
    sid = checkpoint.session_id
    error = error.model_copy(update={"retryable": True})
    elapsed = 0.0
    if checkpoint.retry_since is not None and now is not None:
        elapsed = (now - checkpoint.retry_since).total_seconds()
    if elapsed >= deps.retry_for_s and (served_elsewhere is None or not served_elsewhere()):
        spent = error.model_copy(update={"retryable": False, "message": payloads.clean_error(
            f"{error.message} (retried for {elapsed:.0f} s; LOUSHO_RETRY_FOR_S is {deps.retry_for_s:g})")})
        return _park(deps, checkpoint, spent)
    delay = retry_delay(checkpoint.failures + 1, retry_after, deps.retry_backoff_max_s)
    seq = deps.store.retry_later(sid, checkpoint.fence, error, delay)
    if seq is None:
        return Outcome.FENCED
    log.warning("step of %s %s: %s (failure %d in a row, next attempt in %.1f s)", sid,
                "handed back" if handing_back else "failed", error.code, checkpoint.failures + 1, delay)
    if delay <= COUNTDOWN_MAX_S:
        # The seq the run is at now: a batch may have saved results before it failed.
        after.seq, after.countdown = seq, delay
    return Outcome.HANDED_BACK if handing_back else Outcome.FAILED


def _hand_back_agent(deps: StepDeps, checkpoint: Checkpoint, after: Next, now: datetime | None) -> Outcome:
    """This worker does not load the run's agent: another worker (of a newer release) will run the step."""
    served = deps.serving(checkpoint.agent)
    unknown = errors.AgentNotFoundError(checkpoint.agent, list(deps.agents))
    message = f"{unknown.message}; this worker cannot run it" + (
        "" if served else "; no live worker has registered it")
    error = LastError(code=unknown.code, message=payloads.clean_error(message), retryable=True)
    outcome = _retry(deps, checkpoint, error, None, after, now, handing_back=True,
                     served_elsewhere=lambda: bool(served))
    if not served:
        # Nobody consumes the agent's queue: no message there. The sweep sends the run, when its retry
        # comes due, to the shared queue, until a worker with the agent registers or the budget is spent.
        after.seq = None
    return outcome


def _hand_back_unreadable(deps: StepDeps, session_id: str, fence: int, exc: errors.CheckpointFormatError,
                          after: Next) -> Outcome:
    """The checkpoint is in a format this release does not read: back to the agent's queue, with backoff.

    Not parked however long it takes: a worker that reads the format is what the deploy brings.
    """
    delay = random.uniform(COUNTDOWN_MAX_S / 2, COUNTDOWN_MAX_S)
    seq = deps.store.retry_later(session_id, fence, LastError(**exc.to_record()), delay)
    if seq is None:
        return Outcome.FENCED
    log.warning("run %s has a newer checkpoint format; handed back", session_id)
    if delay <= COUNTDOWN_MAX_S:
        after.seq, after.countdown = seq, delay
    return Outcome.HANDED_BACK


def _runs_elsewhere(deps: StepDeps, checkpoint: Checkpoint, action: machine.ModelTurn | machine.ToolBatch,
                    refusal: errors.LoushoError) -> bool:
    """Whether another live worker has what this one lacks to resume the run (a deploy under way):
    the tools of the pending calls, or exactly the agent the run was saved with."""
    if isinstance(refusal, errors.ResumeToolMissingError) and isinstance(action, machine.ToolBatch):
        names = {call.name for call in action.calls}
        return any(serving.has_tools(names) for serving in deps.serving(checkpoint.agent))
    if isinstance(refusal, errors.AgentDriftError) and checkpoint.fingerprint is not None:
        return any(serving.fingerprint == checkpoint.fingerprint for serving in deps.serving(checkpoint.agent))
    return False


def retry_delay(failures: int, retry_after: float | None, cap: float) -> float:
    """Exponential backoff with full jitter for the ``failures``-th failure in a row, at most ``cap``.

    A provider's ``Retry-After`` is honoured in full, even above ``cap`` (plus a little jitter, so
    runs told the same time do not all call again in the same second).
    """
    ceiling = min(cap, 0.5 * 2 ** max(failures - 1, 0))
    backoff = random.uniform(ceiling / 2, ceiling)
    if retry_after is not None and retry_after > 0:
        backoff = max(backoff, retry_after + random.uniform(0, min(cap, retry_after) / 10))
    return backoff
