"""A run's row in memory: creating runs and queueing input for them (``store.runs`` for the memory store).

Called with the state's lock held. Steps' own writes (claim, fenced save, failures) stay in
``store.memory.checkpoints``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from store import errors, inputs, payloads, records
from store.memory.state import MemoryState, RunRow, refuse_nul, to_checkpoint


def dump_messages(messages: Sequence[records.Message]) -> str:
    """The inbox body of ``messages`` (JSON text, NULs refused as Postgres refuses them).

    Raises:
        StorageError: a message holds a NUL.
    """
    dumped = [m.dump() for m in messages]
    body = payloads.dumps(dumped)
    refuse_nul(dumped)
    return body


def queue_input(state: MemoryState, session_id: str, agent: str, body: str, idempotency_key: str | None) -> int:
    """Queue the inbox ``body`` for the run (creating it when absent); its inbox number.

    Raises:
        SessionAwaitingApprovalError: the run waits on an approval.
        ConfigurationError: the run belongs to another agent.
        CheckpointCorruptError: the stored run cannot be read (an unreadable run takes no input).
        InputTooLargeError: the run has no room for the input (``store.runs.queue_input``); nothing is written.
    """
    earlier = state.sends.get((session_id, idempotency_key)) if idempotency_key is not None else None
    run = state.runs.get(session_id)
    if earlier is not None and run is not None:
        return earlier
    if run is None:
        now = state.clock()
        state.runs[session_id] = RunRow(
            agent=agent, created_at=now, updated_at=now, seq=state.kept_seq(session_id), inbox_head=1
        )
        number = 1
    else:
        if json.loads(run.document):
            to_checkpoint(session_id, run)  # an unreadable run takes no input: delete it first
        if run.agent != agent:
            raise errors.ConfigurationError(f"session {session_id!r} belongs to agent {run.agent!r}, not {agent!r}")
        if run.status == "awaiting-approval":
            waiting = run.waiting_on()
            raise errors.SessionAwaitingApprovalError(session_id, waiting[0] if waiting else None)
        queued = state.inbox.get(session_id, {})
        held = sum(
            len(text.encode("utf-8"))
            for text in (run.document, body, *(queued[n] for n in queued if n > run.inbox_cursor))
        )
        if not inputs.leaves_room(held):
            raise inputs.no_room(session_id, held, queued=False)
        run.inbox_head += 1
        run.clear_failures()
        number = run.inbox_head
    state.inbox.setdefault(session_id, {})[number] = body
    if idempotency_key is not None:
        state.sends[(session_id, idempotency_key)] = number
    return number


def create_from(state: MemoryState, checkpoint: records.Checkpoint, document: str, queued: str | None) -> bool:
    """Create a run whose state is ``checkpoint`` (stored as ``document``), with the ``queued`` inbox body.

    Returns False, writing nothing, when a run with that id exists.
    """
    sid = checkpoint.session_id
    if sid in state.runs:
        return False
    now = state.clock()
    state.runs[sid] = RunRow(
        agent=checkpoint.agent,
        created_at=now,
        updated_at=now,
        status=checkpoint.status,
        seq=state.kept_seq(sid),
        inbox_head=1 if queued is not None else 0,
        document=document,
    )
    if queued is not None:
        state.inbox.setdefault(sid, {})[1] = queued
    return True
