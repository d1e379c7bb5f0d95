"""Settling an abort: the one save that stops a run as aborted, from the claim, a model turn or a tool batch.

Framework-free (no Celery). The request is stored by the producer (``runs.abort_requested``) and heard by the
step through its claim or the lease's doorbell; this writes what the run looks like once stopped.
"""

from __future__ import annotations

import logging

from store import errors
from store.records import Checkpoint, InboxEntry, Lease
from worker import handoffs, machine
from worker import live as live_events
from worker.context import Outcome, StepDeps, StepResult, save
from worker.live import Live

__all__ = ["confirmed", "settle"]

log = logging.getLogger("lousho.step")


def confirmed(deps: StepDeps, lease: Lease) -> bool:
    """Whether the lease's abort doorbell rang for a request stored in Postgres; a doorbell without one is silenced."""
    if not lease.abort.is_set():
        return False
    if deps.store.abort_requested(lease.session_id):
        return True
    lease.abort.clear()
    return False


def settle(
    deps: StepDeps, checkpoint: Checkpoint, live: Live, inbox: list[InboxEntry] | None, *, drained: bool
) -> StepResult:
    """Stop the run as aborted: every call without a result gets a ``cancelled`` one, queued input is kept.

    ``inbox`` None reads the input queued since the checkpoint's cursor; ``drained`` says the checkpoint
    already merged input this step has not saved.
    """
    sid = checkpoint.session_id
    if inbox is None:
        inbox = deps.store.inbox(sid, checkpoint.inbox_cursor)
    agent = handoffs.agent_for(checkpoint, deps.agents)
    stopped = machine.aborted(checkpoint, inbox, instructions=agent.instructions if agent else "")
    stored = {id(message) for message in checkpoint.messages}
    drafts = [live_events.tool_result(m, None) for m in stopped.messages if m.role == "tool" and id(m) not in stored]
    try:
        save(
            deps,
            stopped,
            drained_inbox=drained or stopped.inbox_cursor != checkpoint.inbox_cursor,
            events=drafts,
            status_before=checkpoint.status,
            settles_abort=True,
            live=live,
        )
    except errors.FencedOutError:
        return StepResult(Outcome.FENCED)
    if deps.signals is not None:
        deps.signals.clear_abort(sid)
    log.info("run %s aborted", sid)
    return StepResult(Outcome.ABORTED)
