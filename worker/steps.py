"""One step of one run: take the lease, claim the fence, load, do one model turn or tool batch, save.

Framework-free: Celery calls ``run_step`` from ``worker.tasks`` and tests call it directly. Every
write is fenced, so a stalled holder's late save is refused and leaves no trace.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import redis

from store import errors, payloads, records
from store.checkpoints import PostgresCheckpointStore
from store.leases import Heartbeat, Lease, LeaseManager
from store.records import Checkpoint, LastError, Message, ToolCall
from worker import machine
from worker.agents import Agent, ToolArgsInvalid, ToolContext
from worker.faults import crash_point

log = logging.getLogger("lousho.step")

Enqueue = Callable[[str, int | None, float], None]


class Outcome(enum.StrEnum):
    """What a step did (logged, counted by the benchmark and tests)."""

    BUSY = "busy"            #: another holder has the lease; dropped, the holder goes on
    UNKNOWN = "unknown"      #: no such run
    STALE = "stale"          #: the message's seq is behind the run; a duplicate, dropped
    IDLE = "idle"            #: nothing to do (paused, finished, parked)
    ADVANCED = "advanced"    #: progress saved, next step enqueued
    FINISHED = "finished"    #: the run finished
    FENCED = "fenced"        #: our save was refused: another holder took over
    FAILED = "failed"        #: the step failed; error recorded, retry scheduled
    PARKED = "parked"        #: the run stopped with a non-retryable error


@dataclass
class StepDeps:
    """What a step needs, built once per worker process."""

    store: PostgresCheckpointStore
    leases: LeaseManager
    heartbeat: Heartbeat
    agents: dict[str, Agent]
    enqueue: Enqueue
    max_attempts: int = 5
    fingerprints: dict[str, dict[str, object]] = field(default_factory=dict)

    def fingerprint(self, agent: Agent) -> dict[str, object]:
        """The agent's fingerprint, computed once per process."""
        if agent.name not in self.fingerprints:
            self.fingerprints[agent.name] = agent.fingerprint()
        return self.fingerprints[agent.name]


@dataclass
class _Next:
    seq: int | None = None
    countdown: float = 0.0


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
    after = _Next()
    try:
        crash_point("after_lease_before_epoch", session_id)
        claim = deps.store.claim(session_id, lease.token, seq)
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


def _step(deps: StepDeps, lease: Lease, checkpoint: Checkpoint, inbox_head: int, after: _Next) -> Outcome:
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
    try:
        if isinstance(action, machine.Save):
            return _save_only(deps, agent, action)
        if isinstance(action, machine.ModelTurn):
            return _model_turn(deps, agent, action, after)
        return _tool_batch(deps, lease, agent, action.checkpoint, action.calls, after)
    except errors.FencedOutError:
        return Outcome.FENCED
    except Exception as exc:  # classified and recorded below, never swallowed
        return _record_failure(deps, checkpoint, exc, after)


def _save(deps: StepDeps, checkpoint: Checkpoint, *, drained_inbox: bool = False) -> Checkpoint:
    """Fenced save of ``checkpoint`` as the next seq; raises ``FencedOutError`` when refused."""
    new = checkpoint.model_copy(update={"seq": checkpoint.seq + 1})
    if deps.store.save(new, drained_inbox=drained_inbox) is None:
        log.info("save refused for %s (fence %s): another holder took over", new.session_id, new.fence)
        raise errors.FencedOutError(new.session_id, new.fence)
    return new


def _save_only(deps: StepDeps, agent: Agent, action: machine.Save) -> Outcome:
    checkpoint = action.checkpoint.model_copy(update={"fingerprint": deps.fingerprint(agent)})
    saved = _save(deps, checkpoint, drained_inbox=action.drained_inbox)
    return Outcome.FINISHED if saved.status == "finished" else Outcome.IDLE


def _model_turn(deps: StepDeps, agent: Agent, action: machine.ModelTurn, after: _Next) -> Outcome:
    checkpoint = action.checkpoint
    sid = checkpoint.session_id
    crash_point("during_model_call", sid)
    started = time.perf_counter()
    response = agent.model.generate(list(checkpoint.messages), agent.tool_specs())
    log.debug("model turn of %s took %.1f ms", sid, (time.perf_counter() - started) * 1000)
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
    saved = _save(deps, updated, drained_inbox=action.drained_inbox)
    crash_point("after_model_save_before_enqueue", sid)
    if saved.status == "finished":
        return Outcome.FINISHED
    after.seq = saved.seq
    return Outcome.ADVANCED


class _Batch:
    """Results of one tool batch, saved one by one as they settle, by tool call id."""

    def __init__(self, deps: StepDeps, lease: Lease, checkpoint: Checkpoint) -> None:
        self.deps = deps
        self.lease = lease
        self.checkpoint = checkpoint
        self.lock = threading.Lock()
        self.closed = False
        self.fenced = False

    def may_start(self) -> bool:
        return not (self.closed or self.fenced or self.lease.lost.is_set())

    def settle(self, result: Message) -> None:
        with self.lock:
            if self.closed or self.fenced:
                return
            crash_point("after_tool_effect_before_result_save", self.checkpoint.session_id)
            updated = machine.record_tool_result(self.checkpoint, result)
            try:
                self.checkpoint = _save(self.deps, updated)
            except errors.FencedOutError:
                self.fenced = True
                self.lease.lost.set()
                return
            crash_point("between_results", self.checkpoint.session_id)


def _tool_batch(deps: StepDeps, lease: Lease, agent: Agent, checkpoint: Checkpoint, calls: list[ToolCall],
                after: _Next) -> Outcome:
    batch = _Batch(deps, lease, checkpoint)

    def run_one(call: ToolCall) -> None:
        if not batch.may_start():
            return
        batch.settle(_execute(agent, checkpoint, call))

    try:
        workers = min(agent.tool_concurrency, len(calls))
        if workers <= 1:
            for call in calls:
                run_one(call)
        else:
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lousho-tool") as pool:
                for future in [pool.submit(run_one, call) for call in calls]:
                    future.result()
    finally:
        with batch.lock:
            batch.closed = True
    if batch.fenced:
        return Outcome.FENCED
    if batch.checkpoint.pending_tool_calls:
        # The lease was lost before every call ran; the new holder runs the rest.
        return Outcome.FENCED
    crash_point("after_batch_save_before_enqueue", checkpoint.session_id)
    after.seq = batch.checkpoint.seq
    return Outcome.ADVANCED


def _execute(agent: Agent, checkpoint: Checkpoint, call: ToolCall) -> Message:
    """Run one call and turn whatever happens into its result message."""
    tool = agent.tools.get(call.name)
    if tool is None:
        return machine.tool_error(call, "not-found", "ToolNotFound", f"no tool named {call.name!r}")
    context = ToolContext(tool_call_id=call.id, session_id=checkpoint.session_id, agent=agent.name,
                          step=checkpoint.step, business_state=checkpoint.business_state,
                          checkpoint_seq=checkpoint.seq)
    try:
        tool.validate(call.args)
        if tool.requires_approval(call.args, context):
            return machine.tool_error(call, "denied", "ApprovalUnavailable",
                                      "this tool needs a human approval, which this release cannot ask for")
        crash_point("tool_before_effect", checkpoint.session_id)
        value = tool.invoke(call.args, context)
    except ToolArgsInvalid as exc:
        return machine.tool_error(call, "validation", "ToolArgsInvalid", str(exc))
    except Exception as exc:  # a raising tool becomes an error result for the model
        return machine.tool_error(call, "execution", type(exc).__name__, str(exc))
    return machine.tool_message(call, value)


def _park(deps: StepDeps, checkpoint: Checkpoint, error: LastError) -> Outcome:
    deps.store.record_failure(checkpoint.session_id, checkpoint.fence, error.model_copy(update={"retryable": False}))
    log.warning("run %s parked: %s", checkpoint.session_id, error.code)
    return Outcome.PARKED


def _record_failure(deps: StepDeps, checkpoint: Checkpoint, exc: Exception, after: _Next) -> Outcome:
    if isinstance(exc, errors.LoushoError):
        error = LastError(code=exc.code, message=exc.message[:2000], retryable=exc.retryable)
    else:
        error = LastError(code="LOUSHO_AGENT_EXECUTION_FAILED",
                          message=f"{type(exc).__name__}: {str(exc)[:1000]}", retryable=True)
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
    after.countdown = min(0.25 * 2 ** checkpoint.attempts, 5.0)
    return Outcome.FAILED
