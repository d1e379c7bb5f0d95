"""Listings over the in-memory runs: latest checkpoints, pages of runs, pending runs, and runs the sweep may move.

The ``PostgresCheckpointStore`` queries of the same names, for a ``MemoryState`` whose lock the caller holds.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

from store import errors, records, runs
from store import listing as run_listing
from store.memory.state import MemoryState, RunRow, to_checkpoint


def _by_creation(wanted: Iterable[tuple[str, RunRow]], limit: int, newest: bool = False) -> list[tuple[str, RunRow]]:
    return [
        (sid, run)
        for _, sid, run in sorted(
            ((run.created_at, sid, run) for sid, run in wanted), key=lambda item: (item[0], item[1]), reverse=newest
        )[:limit]
    ]


def latest(
    state: MemoryState, statuses: Iterable[str] | None, agent: str | None, limit: int, newest: bool = False
) -> list[records.Checkpoint | records.PendingRun]:
    """Latest checkpoints by creation, optionally filtered; an unreadable one comes as a ``PendingRun``."""
    wanted = None if statuses is None else set(statuses)
    rows = _by_creation(
        (
            (sid, run)
            for sid, run in state.runs.items()
            if (wanted is None or run.status in wanted) and (agent is None or run.agent == agent)
        ),
        limit,
        newest,
    )
    found: list[records.Checkpoint | records.PendingRun] = []
    for sid, run in rows:
        try:
            found.append(to_checkpoint(sid, run))
        except (errors.CheckpointCorruptError, errors.CheckpointFormatError) as exc:
            found.append(records.unreadable_run(sid, run.agent, run.status, run.attempts, exc, listed=True))
    return found


def _listed(state: MemoryState, session_id: str, run: RunRow, details: bool = False) -> records.ListedRun:
    """The run's row as a listing shows it (its document read only for a stopped run's finish reason, or details)."""
    document: Any = None
    if run.aborted or details:
        try:
            document = json.loads(run.document)
        except ValueError:
            document = None
    document = document if isinstance(document, dict) else {}
    finish_reason = document.get("finish_reason")
    last_error = None if run.last_error is None else records.LastError.model_validate(run.last_error)
    more: dict[str, Any] = {}
    if details:
        more = {
            "finish_reason": finish_reason,
            "step": run_listing.step_of(document.get("step")),
            "usage": run_listing.usage_of(document.get("usage")),
        }
    return records.ListedRun(
        session_id=session_id,
        agent=run.agent,
        status=run.status,
        parent_id=run.parent_id,
        state=state_of(state, session_id, run, finish_reason, last_error),
        created_at=run.created_at,
        updated_at=run.updated_at,
        last_error=last_error,
        attempts=run.attempts,
        failures=run.failures,
        next_attempt_at=run.next_attempt_at,
        **more,
    )


def state_of(
    state: MemoryState, session_id: str, run: RunRow, finish_reason: str | None, last_error: records.LastError | None
) -> records.ListedState:
    """Where the run stands (``records.listed_state`` on the row, as ``store.listing.STATE`` reads it)."""
    return records.listed_state(
        run.status,
        run.aborted,
        finish_reason,
        last_error,
        run.next_attempt_at,
        waiting=run.waiting,
        queued=run.inbox_head > run.inbox_cursor,
        end_due=run.end_due,
        own_approvals=own_approvals(state, session_id),
    )


def own_approvals(state: MemoryState, session_id: str) -> bool:
    """Whether the run has an undecided approval of its own (``store.listing.OWN_APPROVALS``)."""
    return any(
        approval.session_id == session_id and approval.status == "pending" for approval in state.approvals.values()
    )


def runs_page(
    state: MemoryState,
    wanted: run_listing.RunFilter,
    limit: int,
    position: run_listing.Position | None,
    details: bool = False,
) -> records.RunsPage:
    """A page of runs matching ``wanted`` from ``position`` (see ``PostgresCheckpointStore.list_runs``)."""
    newer = position is not None and position.direction == "newer"
    found = []
    for sid, run in _matching(state, wanted):
        if position is not None:
            key, at = (run.created_at, sid), (position.created_at, position.session_id)
            if (key <= at) if newer else (key >= at):
                continue
        found.append(_listed(state, sid, run, details))
    found.sort(key=lambda r: (r.created_at, r.session_id), reverse=not newer)
    return run_listing.page_of(found[: limit + 1], limit, position)


def counts(state: MemoryState, wanted: run_listing.RunFilter) -> dict[records.ListedState, int]:
    """How many runs matching ``wanted`` stand in each state (see ``PostgresCheckpointStore.count_runs``)."""
    found = Counter(_listed(state, sid, run).state for sid, run in _matching(state, wanted))
    return {name: found[name] for name in records.LISTED_STATES if found[name]}


def _matching(state: MemoryState, wanted: run_listing.RunFilter) -> Iterator[tuple[str, RunRow]]:
    """The runs ``wanted`` keeps, in no order."""
    for sid, run in state.runs.items():
        if wanted.agents is not None and run.agent not in wanted.agents:
            continue
        if wanted.id_contains is not None and wanted.id_contains.lower() not in sid.lower():
            continue
        if wanted.since is not None and run.created_at < wanted.since:
            continue
        if wanted.states is None or _listed(state, sid, run).state in wanted.states:
            yield sid, run


def pending(state: MemoryState, agent: str | None, limit: int) -> list[records.PendingRun]:
    """Runs that are not finished, oldest first; an unreadable one is listed parked as corrupt."""
    rows = _by_creation(
        (
            (sid, run)
            for sid, run in state.runs.items()
            if (run.status == "awaiting-approval" or run.aborted or run.waiting or runs.has_work(run))
            and (agent is None or run.agent == agent)
        ),
        limit,
    )
    found = []
    for sid, run in rows:
        try:
            checkpoint = to_checkpoint(sid, run)
            first = state.approvals.get(checkpoint.approval_ids[0]) if checkpoint.approval_ids else None
            found.append(
                records.pending_run(
                    checkpoint,
                    first.kind if first is not None else None,
                    queued=run.inbox_head > run.inbox_cursor,
                    own_approvals=own_approvals(state, sid),
                )
            )
        except (errors.CheckpointCorruptError, errors.CheckpointFormatError) as exc:
            found.append(records.unreadable_run(sid, run.agent, run.status, run.attempts, exc, run.next_attempt_at))
    return found


def due(state: MemoryState, stale_after_s: float, limit: int, after: records.DueRun | None) -> list[records.DueRun]:
    """Runs a step can move now, most overdue first: silent for ``stale_after_s`` or due for a retry.

    Never parked runs, nor runs the sweep sent less than ``stale_after_s`` ago; ``after`` continues a listing.
    """
    now = state.clock()
    cutoff = now - timedelta(seconds=stale_after_s)
    found = []
    for sid, run in state.runs.items():
        if not runs.has_work(run) or runs.is_parked(run.last_error):
            continue
        if run.swept_at is not None and run.swept_at >= cutoff:
            continue
        due_at = run.next_attempt_at or run.updated_at
        moving = run.updated_at < cutoff if run.next_attempt_at is None else run.next_attempt_at <= now
        if moving and (after is None or (due_at, sid) > (after.due, after.session_id)):
            found.append(
                records.DueRun(
                    session_id=sid, seq=run.seq, agent=run.agent, retrying=run.next_attempt_at is not None, due=due_at
                )
            )
    found.sort(key=lambda r: (r.due, r.session_id))
    return found[:limit]


def waiting_leads(state: MemoryState, stale_after_s: float, limit: int) -> list[records.DueRun]:
    """Leads waiting on children none of which can still move (see ``PostgresCheckpointStore.waiting_leads``)."""
    cutoff = state.clock() - timedelta(seconds=stale_after_s)
    found = []
    for sid, run in sorted(state.runs.items(), key=lambda item: item[1].updated_at):
        if not run.waiting or run.updated_at >= cutoff or (run.swept_at is not None and run.swept_at >= cutoff):
            continue
        children = [child for child in state.runs.values() if child.parent_id == sid]
        if not children_moving(state, sid) and (
            not children
            or any(child.updated_at > run.updated_at and not records.is_refused(child.last_error) for child in children)
            or _waits_on_settled(state, sid, run)
        ):
            found.append(records.DueRun(session_id=sid, seq=run.seq, agent=run.agent, due=run.updated_at))
    return found[:limit]


def _waits_on_settled(state: MemoryState, session_id: str, run: RunRow) -> bool:
    """Whether a child the lead waits on (its delegated calls', else its background tasks) settled."""
    document = json.loads(run.document)
    delegated = document.get("delegated")
    waited = list(delegated.values()) if isinstance(delegated, dict) else list(document.get("background") or [])
    for child_id in waited:
        child = state.runs.get(child_id)
        if (
            child is not None
            and child.parent_id == session_id
            and (
                child.status == "finished"
                or child.aborted
                or (runs.is_parked(child.last_error) and not records.is_refused(child.last_error))
            )
        ):
            return True
    return False


def children_moving(state: MemoryState, session_id: str) -> bool:
    """Whether a child of the run can still move by itself (has work and is not parked)."""
    return any(
        child.parent_id == session_id and runs.has_work(child) and not runs.is_parked(child.last_error)
        for child in state.runs.values()
    )
