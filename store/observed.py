"""The facts ``store.explain`` judges a run on, read at one moment, in Postgres, Redis and the broker.

Its row, approvals and children in Postgres, its lease in Redis, its step messages in the broker, and whether a
live worker serves its agent. One statement reads the Postgres side of one run (``describe``) or of every unfinished
run nothing recently changed (``lousho doctor``); the leases are read in one round trip and the broker's queues
once per look. It must not write, nor decide anything (``store.explain`` does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import redis
from sqlalchemy import Connection, text

from store import broker, keys, listing, records, runs, summaries
from store.explain import Observed
from store.redis_client import translated
from store.settings import Settings

#: A child that has not settled: it can still move by itself, waits on its own children, or on a person (a decision,
#: or a refusal to resume it that a person fixes).
_UNSETTLED_CHILD = (
    f"(({runs.has_work_sql('c')} AND {runs.not_parked_sql('c')}) OR c.status = 'awaiting-approval'"
    f" OR (c.waiting AND c.status = 'in-progress' AND NOT c.aborted) OR {runs.refused_sql('c')})"
)
#: The latest moment something gave the run work or was seen moving it: its save, a retry time, an abort request,
#: input sent after its cursor, a decision on its approvals, a child's save, or the sweep sending it a step.
_SINCE = """GREATEST(updated_at, next_attempt_at, abort_requested, swept_at,
  (SELECT max(i.created_at) FROM inbox i WHERE i.session_id = runs.session_id AND i.n > runs.inbox_cursor),
  (SELECT max(a.decided_at) FROM approvals a WHERE a.session_id = runs.session_id),
  (SELECT max(c.updated_at) FROM runs c WHERE c.parent_id = runs.session_id))"""
# The run's pending approvals are its own and those its document names (a lead paused on its children's): looked up
# by id (``= ANY(ARRAY(...))``), one index lookup each; as an OR, the planner reads every pending approval.
_FACTS = f"""SELECT session_id, agent, status, seq, parent_id, created_at, updated_at, last_error, attempts, failures,
  next_attempt_at, document ->> 'finish_reason' AS finish_reason, document -> 'step' AS step,
  document -> 'usage' AS usage, ({listing.STATE_PER_ROW}) AS state,
  ARRAY(SELECT a.approval_id FROM approvals a WHERE a.status = 'pending'
        AND a.approval_id = ANY(ARRAY(SELECT o.approval_id FROM approvals o WHERE o.session_id = runs.session_id
                                      UNION ALL SELECT jsonb_array_elements_text(runs.document -> 'approval_ids')))
        ORDER BY a.created_at, a.approval_id) AS approval_ids,
  ARRAY(SELECT c.session_id FROM runs c WHERE c.parent_id = runs.session_id AND {_UNSETTLED_CHILD}
        ORDER BY c.created_at, c.session_id) AS children,
  {_SINCE} AS since,
  EXISTS (SELECT 1 FROM agent_workers w WHERE w.agent = runs.agent
          AND w.seen_at > now() - make_interval(secs => :window)) AS served,
  now() AS now"""
#: What the run's workers recorded its model turns cost (``step.done`` events): read for ``describe`` only, as it
#: reads every event of the run.
_COST = """(SELECT sum((e.data ->> 'cost')::float8) FROM run_events e WHERE e.session_id = runs.session_id
  AND e.type = 'step.done' AND jsonb_typeof(e.data -> 'cost') = 'number') AS cost"""
_ONE = text(f"{_FACTS}, {_COST} FROM runs WHERE session_id = :sid")
# Unfinished runs (the partial indexes of the sweep, of paused and of waiting runs find them) that nothing changed
# for ``grace`` seconds: the only ones an owner, a timer or a waiter must explain by now.
_QUIET = text(f"""{_FACTS} FROM runs
WHERE ({runs.HAS_WORK} OR status = 'awaiting-approval' OR waiting) AND {runs.NOT_PARKED}
  AND updated_at < now() - make_interval(secs => :grace)
ORDER BY updated_at, session_id LIMIT :limit""")


@dataclass(frozen=True)
class Look:
    """The facts of some runs at one moment, with their summaries (without ``waiting_on`` and ``next_action``)."""

    observed: tuple[Observed, ...]
    summarized: tuple[summaries.RunSummary, ...]
    #: Every queue message and unacked entry was read (a backlog past ``broker.MAX_MESSAGES`` was not).
    broker_complete: bool = True


def grace(settings: Settings) -> timedelta:
    """How long a run may go without an owner, a timer or a waiter (I19): a lease TTL plus a sweep interval."""
    return timedelta(seconds=settings.lease_ttl_ms / 1000 + settings.recover_interval_s)


def registration_window_s(settings: Settings) -> float:
    """How recent a worker's registration must be for it to count as live (several missed refreshes)."""
    return 4 * max(0.5, min(15.0, settings.recover_interval_s))


def one(conn: Connection, session_id: str, settings: Settings) -> list[Any]:
    """The Postgres facts of run ``session_id`` (no row when it is unknown)."""
    return list(conn.execute(_ONE, {"sid": session_id, "window": registration_window_s(settings)}).all())


_BUSINESS_STATE = text("SELECT document -> 'business_state' FROM runs WHERE session_id = :sid")


def business_state(conn: Connection, session_id: str) -> Any:
    """Run ``session_id``'s business state as last saved (None when it has none, or is unknown)."""
    return conn.execute(_BUSINESS_STATE, {"sid": session_id}).scalar()


def quiet(conn: Connection, settings: Settings, limit: int) -> list[Any]:
    """The Postgres facts of the unfinished runs nothing changed for a grace, oldest first (at most ``limit``)."""
    return list(
        conn.execute(
            _QUIET,
            {"grace": grace(settings).total_seconds(), "limit": limit, "window": registration_window_s(settings)},
        ).all()
    )


@translated
def look(rows: Sequence[Any], leases: redis.Redis, broker_client: redis.Redis, settings: Settings) -> Look:
    """The facts of ``rows`` (from ``one`` or ``quiet``) with their leases and step messages read now.

    Leases and the broker are read only for runs that have work (the others are explained without them).

    Raises:
        StorageError: Redis or the broker could not be read.
    """
    base = [_observed(row) for row in rows]
    moving = [o for o in base if o.state in ("running", "retrying", "waiting", "awaiting-approval")]
    holders = _leases(leases, [o.session_id for o in moving], settings.lease_ttl_ms)
    limited = _limit_waits(leases, [o.session_id for o in moving])
    seqs = {row.session_id: int(row.seq) for row in rows}
    complete = True
    scan = broker.Scan((), True)
    if moving:
        queues = [settings.queue, *sorted({settings.agent_queue(o.agent) for o in moving})]
        scan = broker.scan(broker_client, queues, {o.session_id for o in moving})
        complete = scan.complete
    observed = tuple(
        replace(
            o,
            lease_holder=holders.get(o.session_id, (None, None))[0],
            lease_age_ms=holders.get(o.session_id, (None, None))[1],
            step_message=scan.for_run(o.session_id, seqs[o.session_id]),
            model_limit=limited.get(o.session_id),
        )
        for o in base
    )
    return Look(observed, tuple(_summary(row) for row in rows), complete)


def _observed(row: Any) -> Observed:
    return Observed(
        session_id=row.session_id,
        agent=row.agent,
        state=row.state,
        now=row.now,
        since=row.since,
        last_error=None if row.last_error is None else records.LastError.model_validate(row.last_error),
        next_attempt_at=row.next_attempt_at,
        approval_ids=tuple(row.approval_ids or ()),
        children=tuple(row.children or ()),
        agent_served=bool(row.served),
    )


def _summary(row: Any) -> summaries.RunSummary:
    return summaries.RunSummary(
        session_id=row.session_id,
        agent=row.agent,
        state=row.state,
        status=row.status,
        finish_reason=summaries.finish_reason(row.status, row.finish_reason),
        step=listing.step_of(row.step) or 0,
        usage=listing.usage_of(row.usage) or records.Usage(),
        cost=_cost(row),
        last_error=row.last_error,
        attempts=row.attempts,
        failures=row.failures,
        next_attempt_at=row.next_attempt_at,
        parent_id=row.parent_id,
        created_at=row.created_at,
        updated_at=row.updated_at,
    )


def _cost(row: Any) -> float | None:
    cost = getattr(row, "cost", None)
    return None if cost is None else float(cost)


def _limit_waits(client: redis.Redis, session_ids: list[str]) -> dict[str, tuple[str, str]]:
    """The runs among ``session_ids`` waiting on a model limit: (limit key, reason) by run (one round trip)."""
    if not session_ids:
        return {}
    found = {}
    for session_id, mark in zip(session_ids, client.mget([keys.wait_key(s) for s in session_ids]), strict=True):
        if mark is not None:
            key, _, reason = (mark.decode() if isinstance(mark, bytes) else str(mark)).partition(" ")
            found[session_id] = (key, reason)
    return found


def _leases(client: redis.Redis, session_ids: list[str], ttl_ms: int) -> dict[str, tuple[str, int | None]]:
    """The live leases among ``session_ids``: holder and milliseconds since it was taken or renewed (one round trip)."""
    if not session_ids:
        return {}
    pipe = client.pipeline(transaction=False)
    for session_id in session_ids:
        key = keys.lease_key(session_id)
        pipe.get(key)
        pipe.pttl(key)
    answers = pipe.execute()
    found: dict[str, tuple[str, int | None]] = {}
    for session_id, holder, left in zip(session_ids, answers[::2], answers[1::2], strict=True):
        if holder is not None:
            age = ttl_ms - int(left) if isinstance(left, int) and left >= 0 else None
            found[session_id] = (holder.decode() if isinstance(holder, bytes) else str(holder), age)
    return found


__all__ = ["Look", "grace", "look", "one", "quiet", "registration_window_s"]
