"""One step of one run: take the lease, claim the fence, load, do one model turn or tool batch, save.

Framework-free: Celery calls ``run_step`` from ``worker.tasks`` and tests call it directly. Every
write is fenced, so a stalled holder's late save is refused and leaves no trace.
"""

from __future__ import annotations

import logging
import random
import time

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
        outcome = _step(deps, lease, checkpoint, claim.inbox_head, after)
    finally:
        deps.heartbeat.drop(lease)
        try:
            deps.leases.release(lease)
        except redis.RedisError:
            log.warning("could not release lease of %s; it expires by itself", session_id)
    if after.seq is not None:
        # After the release: the next step must find the lease free, or it would be dropped as busy.
        deps.enqueue(session_id, after.seq, after.countdown)
        crash_point("after_enqueue_before_ack", session_id)
    return outcome


def _step(deps: StepDeps, lease: Lease, checkpoint: Checkpoint, inbox_head: int, after: Next) -> Outcome:
    if checkpoint.last_error is not None and not checkpoint.last_error.retryable:
        return Outcome.IDLE
    if checkpoint.attempts > deps.max_attempts:
        exceeded = errors.StepAttemptsExceededError(
            f"step started {checkpoint.attempts} times without progress; run parked")
        return _park(deps, checkpoint, LastError(**exceeded.to_record()))
    agent = deps.agents.get(checkpoint.agent)
    if agent is None:
        unknown = errors.AgentNotFoundError(checkpoint.agent, list(deps.agents))
        return _park(deps, checkpoint, LastError(**unknown.to_record()))
    inbox = []
    if inbox_head > checkpoint.inbox_cursor:
        inbox = deps.store.inbox(checkpoint.session_id, checkpoint.inbox_cursor)
    action = machine.plan(checkpoint, inbox, instructions=agent.instructions, max_steps=agent.max_steps)
    if isinstance(action, machine.Idle):
        return Outcome.IDLE
    if isinstance(action, machine.ModelTurn | machine.ToolBatch):
        refusal = _check_resume(deps, agent, checkpoint, action)
        if refusal is not None:
            return _refuse(deps, checkpoint, refusal)
    try:
        if isinstance(action, machine.Save):
            return _save_only(deps, agent, action)
        if isinstance(action, machine.ModelTurn):
            return _model_turn(deps, agent, action, after)
        return run_batch(deps, lease, agent, action.checkpoint, action.calls, after)
    except errors.FencedOutError:
        return Outcome.FENCED
    except Exception as exc:  # classified and recorded below, never swallowed
        return _record_failure(deps, checkpoint, exc, after)


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


def _record_failure(deps: StepDeps, checkpoint: Checkpoint, exc: Exception, after: Next) -> Outcome:
    # Messages can quote a provider's response: a NUL in them would make the failure unrecordable.
    if isinstance(exc, errors.LoushoError):
        error = LastError(code=exc.code, message=payloads.clean_text(exc.message[:2000]), retryable=exc.retryable)
    else:
        error = LastError(code="LOUSHO_AGENT_EXECUTION_FAILED",
                          message=payloads.clean_text(f"{type(exc).__name__}: {str(exc)[:1000]}"), retryable=True)
    if error.retryable and checkpoint.attempts >= deps.max_attempts:
        error = error.model_copy(update={"retryable": False,
                                         "message": f"{error.message} (after {checkpoint.attempts} attempts)"})
    if deps.store.record_failure(checkpoint.session_id, checkpoint.fence, error) is None:
        return Outcome.FENCED
    log.warning("step of %s failed: %s (attempt %d, retryable=%s)", checkpoint.session_id, error.code,
                checkpoint.attempts, error.retryable)
    if not error.retryable:
        return Outcome.PARKED
    after.seq = checkpoint.seq
    after.countdown = retry_delay(checkpoint.attempts, getattr(exc, "retry_after", None), deps.retry_backoff_max_s)
    return Outcome.FAILED


def retry_delay(attempts: int, retry_after: float | None, cap: float) -> float:
    """Exponential backoff with full jitter, at least the provider's ``Retry-After``, at most ``cap``."""
    backoff = random.uniform(0, min(cap, 0.5 * 2 ** max(attempts - 1, 0)))
    if retry_after is not None and retry_after > 0:
        backoff = max(backoff, retry_after)
    return min(backoff, cap)
