"""Retries of a step that could not finish: backoff, hand-backs during a deploy, and parking.

Framework-free (no Celery): records the failure under the run's fence and returns the follow-up
message; ``worker.steps`` sends it once the lease is released.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from datetime import datetime

from store import errors, payloads, telemetry
from store.records import Checkpoint, EventDraft, LastError
from worker import live
from worker.context import Next, Outcome, StepDeps, StepResult

#: The longest wait sent as a Celery countdown; longer waits are kept in Postgres (``next_attempt_at``)
#: and honoured by the recovery sweep, since delayed messages age in the broker (RELIABILITY P1).
COUNTDOWN_MAX_S = 5.0

log = logging.getLogger("lousho.step")


def _stopped(checkpoint: Checkpoint, error: LastError) -> list[EventDraft]:
    """The events of a run that stopped on ``error``: the error, and the end of its input."""
    return [live.error(error), live.run_done(checkpoint, "error")]


def park(deps: StepDeps, checkpoint: Checkpoint, error: LastError) -> StepResult:
    """Park the run: record ``error`` as not retryable, so no step runs until the run is resumed."""
    error = error.model_copy(update={"retryable": False})
    deps.store.record_failure(checkpoint.session_id, checkpoint.fence, error, _stopped(checkpoint, error))
    telemetry.note(error_code=error.code)
    log.warning("run %s parked: %s", checkpoint.session_id, error.code)
    return StepResult(Outcome.PARKED)


def record_failure(deps: StepDeps, checkpoint: Checkpoint, exc: Exception, now: datetime | None) -> StepResult:
    """Record why a step failed: park the run when ``exc`` is not retryable, else retry it later."""
    # Messages can quote a provider's response or a key: cleaned and masked before they are stored.
    if isinstance(exc, errors.LoushoError):
        error = LastError(code=exc.code, message=payloads.clean_error(exc.message), retryable=exc.retryable)
    else:
        error = LastError(
            code="LOUSHO_AGENT_EXECUTION_FAILED",
            message=payloads.clean_error(f"{type(exc).__name__}: {str(exc)[:1000]}"),
            retryable=True,
        )
    if not error.retryable:
        if (
            deps.store.record_failure(checkpoint.session_id, checkpoint.fence, error, _stopped(checkpoint, error))
            is None
        ):
            return StepResult(Outcome.FENCED)
        telemetry.note(error_code=error.code)
        log.warning("step of %s failed: %s (not retryable; run parked)", checkpoint.session_id, error.code)
        return StepResult(Outcome.PARKED)
    return retry_later(deps, checkpoint, error, getattr(exc, "retry_after", None), now)


def retried_for(checkpoint: Checkpoint, now: datetime | None) -> float:
    """Seconds the run's current streak of transient failures has lasted (0 without one)."""
    if checkpoint.retry_since is None or now is None:
        return 0.0
    return (now - checkpoint.retry_since).total_seconds()


def retry_later(
    deps: StepDeps,
    checkpoint: Checkpoint,
    error: LastError,
    retry_after: float | None,
    now: datetime | None,
    *,
    handing_back: bool = False,
    served_elsewhere: Callable[[], bool] | None = None,
    max_delay: float | None = None,
    events: Sequence[EventDraft] = (),
) -> StepResult:
    """Record a transient failure and when to try again, or park the run once the retry budget is spent.

    Waits up to ``COUNTDOWN_MAX_S`` go out as a countdown message; longer ones wait in Postgres
    for the sweep. While ``served_elsewhere`` says a live worker can run the step, the budget
    does not park the run. ``max_delay`` caps the wait (a deadline of the caller's own). ``events`` are
    written with the failure, after its own.
    """
    sid = checkpoint.session_id
    error = error.model_copy(update={"retryable": True})
    elapsed = retried_for(checkpoint, now)
    if elapsed >= deps.retry_for_s and (served_elsewhere is None or not served_elsewhere()):
        spent = error.model_copy(
            update={
                "retryable": False,
                "message": payloads.clean_error(
                    f"{error.message} (retried for {elapsed:.0f} s; LOUSHO_RETRY_FOR_S is {deps.retry_for_s:g})"
                ),
            }
        )
        return park(deps, checkpoint, spent)
    delay = retry_delay(checkpoint.failures + 1, retry_after, deps.retry_backoff_max_s)
    if max_delay is not None:
        delay = min(delay, max(max_delay, 0.0))
    drafts: list[EventDraft] = []
    if not handing_back:  # a deploy under way is not the run's failure
        drafts.append(
            live.provider_retry(error, checkpoint.failures + 1, delay)
            if error.code == errors.ProviderError.code
            else live.error(error)
        )
    drafts.extend(events)
    seq = deps.store.retry_later(sid, checkpoint.fence, error, delay, drafts)
    if seq is None:
        return StepResult(Outcome.FENCED)
    telemetry.note(error_code=error.code, retry_in=delay)
    log.warning(
        "step of %s %s: %s (failure %d in a row, next attempt in %.1f s)",
        sid,
        "handed back" if handing_back else "failed",
        error.code,
        checkpoint.failures + 1,
        delay,
    )
    # The seq the run is at now: a batch may have saved results before it failed.
    follow_up = Next(seq, delay, checkpoint.current_agent) if delay <= COUNTDOWN_MAX_S else None
    return StepResult(Outcome.HANDED_BACK if handing_back else Outcome.FAILED, follow_up)


def hand_back_agent(deps: StepDeps, checkpoint: Checkpoint, now: datetime | None) -> StepResult:
    """Hand the step back: this worker does not load the run's agent, another (of a newer release) will.

    A name no worker has ever registered (a typo sent before any worker registered anything, when ``send``
    cannot check names) is not a deploy under way: the run is parked once ``agent_grace_s`` has passed since its
    first input, and retried no later than that until then. An agent some worker registered keeps waiting for a
    worker within the retry budget (RELIABILITY I13).
    """
    agent = checkpoint.current_agent
    served = deps.serving(agent)
    unknown = errors.AgentNotFoundError(agent, list(deps.agents))
    unregistered_for = None if served else deps.unregistered_for(agent, checkpoint.session_id)
    if unregistered_for is not None and unregistered_for >= deps.agent_grace_s:
        message = (
            f"{unknown.message}; no live worker has registered it, and no worker ever has (waited"
            f" {unregistered_for:.0f} s,"
            f" LOUSHO_AGENT_GRACE_S is {deps.agent_grace_s:g}): check the agent's name, then resume the run"
            " or send again"
        )
        return park(deps, checkpoint, LastError(code=unknown.code, message=payloads.clean_error(message)))
    if unregistered_for is not None:
        reason = f"no worker has registered agent {agent!r}; parked after LOUSHO_AGENT_GRACE_S unless one does"
        message = (
            f"{unknown.message}; this worker cannot run it; no live worker has registered it, and no worker ever has"
        )
    elif not served:
        reason = f"no live worker serves agent {agent!r}; waiting for one"
        message = f"{unknown.message}; this worker cannot run it; no live worker has registered it"
    else:
        reason, message = None, f"{unknown.message}; this worker cannot run it"
    telemetry.note(hand_back=reason)
    error = LastError(code=unknown.code, message=payloads.clean_error(message), retryable=True)
    deadline = None if unregistered_for is None else deps.agent_grace_s - unregistered_for
    result = retry_later(
        deps, checkpoint, error, None, now, handing_back=True, served_elsewhere=lambda: bool(served), max_delay=deadline
    )
    if not served:
        # Nobody consumes the agent's queue: no message there. The sweep sends the run, when its retry
        # comes due, to the shared queue, until a worker with the agent registers or the budget is spent.
        return StepResult(result.outcome)
    return result


def hand_back_unreadable(deps: StepDeps, session_id: str, fence: int, exc: errors.CheckpointFormatError) -> StepResult:
    """Hand the step back: the checkpoint is in a format this release does not read; recorded as a retry.

    No follow-up message: the recovery sweep sends the run once the retry comes due, to the queue of
    its agent when a live worker serves it. Not parked however long it takes: a worker that reads the
    format is what the deploy brings.
    """
    delay = random.uniform(COUNTDOWN_MAX_S / 2, COUNTDOWN_MAX_S)
    if deps.store.retry_later(session_id, fence, LastError(**exc.to_record()), delay) is None:
        return StepResult(Outcome.FENCED)
    log.warning("run %s has a newer checkpoint format; handed back", session_id)
    return StepResult(Outcome.HANDED_BACK)


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
