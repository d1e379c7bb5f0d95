"""The I19 checker: every unfinished run has an owner, a timer or a waiter; ``lousho doctor`` and a beat task look.

A look reads the facts of every unfinished run nothing changed for a grace (``store.observed``), judges each by
``store.explain``, and keeps what it saw in Postgres: a run nothing explains past the grace is a *suspect*, and
counts as *unexplained* once a later look, at least a sweep interval after the first that suspected it, still sees
it so with nothing changed (an outage of Postgres or Redis, or a look between a lost message and the sweep's resend,
then raises no alarm). The latest look's count is what ``/metrics`` reports as ``lousho_runs_unexplained``. It never
moves a run: that is the sweep's and a person's work.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

import redis
from sqlalchemy import Engine, text

from store import explain, observed
from store.database import Transaction
from store.settings import Settings
from store.summaries import RunSummary

#: Most unfinished runs one look reads (the oldest first); a look that reached it says so (``complete`` false).
LOOK_LIMIT = 10_000
#: The name the beat's and the command's looks are kept under in ``doctor_looks``.
CHECKER = "i19"

_PRIOR = text("SELECT session_id, first_seen, since FROM doctor_runs")
_FORGET = text("DELETE FROM doctor_runs WHERE NOT (session_id = ANY(:ids))")
_SUSPECT = text("""
INSERT INTO doctor_runs (session_id, first_seen, since) VALUES (:sid, now(), :since)
ON CONFLICT (session_id) DO UPDATE SET first_seen = now(), since = EXCLUDED.since
WHERE doctor_runs.since IS DISTINCT FROM EXCLUDED.since
""")
_KEEP_LOOK = text("""
INSERT INTO doctor_looks (name, looked_at, unexplained, checked, complete)
VALUES (:name, now(), :unexplained, :checked, :complete)
ON CONFLICT (name) DO UPDATE SET looked_at = now(), unexplained = EXCLUDED.unexplained,
  checked = EXCLUDED.checked, complete = EXCLUDED.complete
RETURNING looked_at
""")
_LATEST = text("SELECT looked_at, unexplained, checked, complete, now() AS now FROM doctor_looks WHERE name = :name")


@dataclass(frozen=True)
class Finding:
    """A run nothing explains: its summary (with ``waiting_on`` and ``next_action``), and since when a look saw it."""

    summary: RunSummary
    first_seen: datetime


@dataclass(frozen=True)
class Report:
    """What one look found."""

    looked_at: datetime
    #: Unfinished runs that nothing changed for a grace, read and judged.
    checked: int
    #: Runs unexplained at two looks a sweep interval apart, nothing changed: invariant I19 broken.
    unexplained: tuple[Finding, ...] = ()
    #: Runs unexplained at this look only: a later look tells whether anything moves them.
    suspects: tuple[Finding, ...] = ()
    #: Every unfinished run and every broker message was read (else the look stopped at ``LOOK_LIMIT`` runs or
    #: ``broker.MAX_MESSAGES`` messages).
    complete: bool = True
    #: When a suspect can be confirmed by the next look (None: no suspect).
    confirm_at: datetime | None = None


def confirm_after(settings: Settings) -> timedelta:
    """How long after a look suspected a run a later look can confirm it: one sweep interval (the sweep had a pass)."""
    return timedelta(seconds=settings.recover_interval_s)


def look(
    engine: Engine, leases: redis.Redis, broker_client: redis.Redis, settings: Settings, limit: int = LOOK_LIMIT
) -> Report:
    """Look at every unfinished run once, keep what was seen, and report the unexplained runs.

    Raises:
        StorageError: Postgres, Redis or the broker could not be read (nothing is kept).
    """
    grace = observed.grace(settings)
    with Transaction(engine) as conn:
        rows = observed.quiet(conn, settings, limit)
    seen = observed.look(rows, leases, broker_client, settings)
    found = []
    for facts, summary in zip(seen.observed, seen.summarized, strict=True):
        told = explain.explain(facts, grace)
        if told.overdue:
            found.append(
                (facts, summary.model_copy(update={"waiting_on": told.waiting_on, "next_action": told.next_action}))
            )
    complete = seen.broker_complete and len(rows) < limit
    with Transaction(engine) as conn:
        prior = {row.session_id: row for row in conn.execute(_PRIOR)}
        conn.execute(_FORGET, {"ids": [facts.session_id for facts, _ in found]})
        for facts, _ in found:
            conn.execute(_SUSPECT, {"sid": facts.session_id, "since": facts.since})
        unexplained: list[Finding] = []
        suspects: list[Finding] = []
        now = seen.observed[0].now if seen.observed else None
        for facts, summary in found:
            before = prior.get(facts.session_id)
            confirmed = (
                before is not None
                and before.since == facts.since
                and facts.now - before.first_seen >= confirm_after(settings)
            )
            first_seen = before.first_seen if before is not None and before.since == facts.since else facts.now
            (unexplained if confirmed else suspects).append(Finding(summary, first_seen))
        looked_at = conn.execute(
            _KEEP_LOOK, {"name": CHECKER, "unexplained": len(unexplained), "checked": len(rows), "complete": complete}
        ).scalar_one()
    confirm_at = min((f.first_seen for f in suspects), default=None)
    return Report(
        looked_at=now or looked_at,
        checked=len(rows),
        unexplained=tuple(unexplained),
        suspects=tuple(suspects),
        complete=complete,
        confirm_at=None if confirm_at is None else confirm_at + confirm_after(settings),
    )


@dataclass(frozen=True)
class Latest:
    """The latest look's figures, as ``/metrics`` reports them."""

    unexplained: int
    checked: int
    complete: bool
    #: Seconds since that look (a beat that stopped looking shows here).
    age_s: float


def latest(engine: Engine) -> Latest | None:
    """The latest look's figures; None when no look was kept yet.

    Raises:
        StorageError: Postgres could not be read.
    """
    with Transaction(engine) as conn:
        row = conn.execute(_LATEST, {"name": CHECKER}).first()
    if row is None:
        return None
    return Latest(
        unexplained=int(row.unexplained),
        checked=int(row.checked),
        complete=bool(row.complete),
        age_s=max(0.0, (row.now - row.looked_at).total_seconds()),
    )


__all__ = ["CHECKER", "LOOK_LIMIT", "Finding", "Latest", "Report", "confirm_after", "latest", "look"]
