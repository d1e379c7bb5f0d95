"""The runs listing: runs filtered in SQL and paged by keyset, newest first by creation, without their transcripts.

A page reads only the control columns of ``runs`` (never ``run_messages``; of the document, only a stopped run's
finish reason), so it costs the same whatever the runs hold and however deep the reader pages. It owns the cursor
format and the SQL of where a run stands (``STATE``, the rule of ``records.listed_state``); it must not write.
"""

from __future__ import annotations

import base64
import binascii
import json
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import Connection, text

from store import errors, records, runs

#: Most runs one page may hold.
MAX_LIMIT = 500
#: Most characters of a run id search (longer ones are refused).
MAX_SEARCH = 200

# ``records.listed_state`` in SQL. The document is read only in the branch of a stopped run, the approvals only for
# a lead paused while it waits on children: CASE evaluates the branch it takes, so a listing never detoasts the
# document of a run that is not stopped.
_IDLE = "inbox_head <= inbox_cursor AND NOT end_due"
#: Whether the run (unaliased ``runs``) has an undecided approval of its own: a lead paused only on its children's
#: approvals has none (an approval row names the run that asked for it). Asked of many runs (a count, a filter by
#: state): written as IN, which Postgres runs as one hashed list of the pending approvals' runs, built once. As a
#: correlated EXISTS the planner costs it per row, and a count over every run then pays for a JIT compilation
#: (100 ms) that the statement never needs.
OWN_APPROVALS = "runs.session_id IN (SELECT a.session_id FROM approvals a WHERE a.status = 'pending')"
#: The same asked of a few runs (a page's rows, one run, a page of pending runs): one lookup of
#: ``approvals_session_idx`` per run, where the hashed list would cost as much as there are pending approvals,
#: whatever the page. ``OFFSET 0`` keeps it a lookup: Postgres would hash the list when it expects many rows before
#: a LIMIT.
OWN_APPROVALS_PER_ROW = (
    "EXISTS (SELECT 1 FROM approvals a WHERE a.session_id = runs.session_id AND a.status = 'pending' OFFSET 0)"
)


def _state(own_approvals: str) -> str:
    """``records.listed_state`` in SQL, asking ``own_approvals`` whether a paused lead has approvals of its own."""
    return f"""CASE WHEN status = 'finished' AND NOT aborted AND {_IDLE} THEN 'finished'
  WHEN aborted AND {_IDLE} THEN CASE WHEN document ->> 'finish_reason' = 'budget-exceeded' THEN 'budget-exceeded'
                                     ELSE 'aborted' END
  WHEN status = 'awaiting-approval' THEN CASE WHEN waiting AND NOT {own_approvals} THEN 'waiting'
                                              ELSE 'awaiting-approval' END
  WHEN NOT COALESCE({runs.NOT_PARKED}, false) THEN 'parked'
  WHEN last_error IS NOT NULL OR next_attempt_at IS NOT NULL THEN 'retrying'
  WHEN waiting THEN 'waiting'
  ELSE 'running' END"""


#: Where a run stands, asked of many runs (a count, a filter by state): ``OWN_APPROVALS``.
STATE = _state(OWN_APPROVALS)
#: Where a run stands, asked of a few runs (a page's rows, one run): ``OWN_APPROVALS_PER_ROW``.
STATE_PER_ROW = _state(OWN_APPROVALS_PER_ROW)
_COLUMNS = (
    f"session_id, agent, status, parent_id, created_at, updated_at, last_error, attempts, failures,"
    f" next_attempt_at, {STATE_PER_ROW} AS state"
)
# ``count`` groups the states in a subquery fenced by OFFSET 0: the planner then hashes the eight states instead of
# sorting every run by its state (it cannot tell the CASE has eight values).
#: What ``details`` adds to a page's rows, from their documents (read for those rows only, after the LIMIT).
_DETAILS = (
    "r.document ->> 'finish_reason' AS finish_reason, r.document -> 'step' AS step, r.document -> 'usage' AS usage"
)

#: Which way a cursor reads from its position: toward older runs, or back toward newer ones.
Direction = Literal["older", "newer"]
_MARKS: dict[Direction, str] = {"older": "o", "newer": "n"}
#: Longest run id a cursor may carry (a child's id is its lead's and a suffix).
_MAX_CURSOR_ID = 1000


@dataclass(frozen=True)
class Position:
    """Where a cursor stands: a listed run's creation time and id (the keyset), and which way it reads."""

    created_at: datetime
    session_id: str
    direction: Direction = "older"

    def cursor(self) -> str:
        """The opaque text a page hands out for this position (URL-safe)."""
        raw = json.dumps([_MARKS[self.direction], self.created_at.isoformat(), self.session_id], separators=(",", ":"))
        return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def parse_cursor(cursor: str) -> Position:
    """The position a page's cursor stands for.

    Raises:
        ConfigurationError: ``cursor`` is not one a page gave (``field="cursor"``).
    """
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        mark, at, session_id = json.loads(raw)
        when = datetime.fromisoformat(at)
        direction = next(name for name, sign in _MARKS.items() if sign == mark)
    except (binascii.Error, ValueError, TypeError, StopIteration):
        raise errors.ConfigurationError("the cursor is not one a runs page gave", field="cursor") from None
    if when.tzinfo is None or not isinstance(session_id, str) or not 0 < len(session_id) <= _MAX_CURSOR_ID:
        raise errors.ConfigurationError("the cursor is not one a runs page gave", field="cursor")
    return Position(when, session_id, direction)


@dataclass(frozen=True)
class RunFilter:
    """What a listing keeps; each part None keeps every run.

    Runs of ``agents``, standing in ``states``, whose id contains ``id_contains`` (whatever the case), created at
    or after ``since``.
    """

    agents: frozenset[str] | None = None
    states: frozenset[records.ListedState] | None = None
    id_contains: str | None = None
    since: datetime | None = None

    @classmethod
    def of(
        cls, agents: Iterable[str] | None, states: Iterable[str] | None, id_contains: str | None, since: datetime | None
    ) -> RunFilter:
        """The filter of a listing's arguments, checked.

        ``paused``, the word of an earlier release, is taken for ``awaiting-approval`` (``records.STATE_ALIASES``).

        Raises:
            ConfigurationError: an unknown state, a naive ``since``, or a search longer than ``MAX_SEARCH``.
        """
        wanted: frozenset[records.ListedState] | None = None
        if states is not None:
            states = list(states)
            for old in sorted(set(states) & set(records.STATE_ALIASES)):
                warnings.warn(
                    f"the run state {old!r} is called {records.STATE_ALIASES[old]!r} now; the old word is"
                    " accepted for one release",
                    DeprecationWarning,
                    stacklevel=3,
                )
            given = frozenset(records.canonical_states(states))
            unknown = sorted(given - set(records.LISTED_STATES))
            if unknown:
                raise errors.ConfigurationError(
                    f"unknown run state {unknown[0]!r}; one of {', '.join(records.LISTED_STATES)}", field="state"
                )
            wanted = frozenset(state for state in records.LISTED_STATES if state in given)
        if since is not None and since.tzinfo is None:
            raise errors.ConfigurationError("since must be a timezone-aware datetime", field="since")
        if id_contains is not None and len(id_contains) > MAX_SEARCH:
            raise errors.ConfigurationError(
                f"a run id search takes at most {MAX_SEARCH} characters", field="id_contains"
            )
        return cls(None if agents is None else frozenset(agents), wanted, id_contains or None, since)


def check_limit(limit: int) -> int:
    """``limit`` when a page may hold that many runs.

    Raises:
        ConfigurationError: ``limit`` is below 1 or above ``MAX_LIMIT``.
    """
    if not 1 <= limit <= MAX_LIMIT:
        raise errors.ConfigurationError(f"a runs page holds 1 to {MAX_LIMIT} runs, not {limit}", field="limit")
    return limit


def page_of(rows: Sequence[records.ListedRun], limit: int, position: Position | None) -> records.RunsPage:
    """The page of ``rows``, read from ``position`` (None: the newest runs) in its direction, one row past ``limit``.

    Rows read toward newer runs come oldest first and are turned around, so every page is newest first.
    """
    more = len(rows) > limit
    items = list(rows[:limit])
    if position is not None and position.direction == "newer":
        items.reverse()

    def at(run: records.ListedRun, direction: Direction) -> str:
        return Position(run.created_at, run.session_id, direction).cursor()

    if position is None or position.direction == "older":
        older = at(items[-1], "older") if more else None
        # Reading on from a cursor, the run it stands on (or the newer runs that came before it) lies behind.
        newer = (
            None
            if position is None
            else (
                at(items[0], "newer") if items else Position(position.created_at, position.session_id, "newer").cursor()
            )
        )
    else:
        newer = at(items[0], "newer") if more else None
        older = at(items[-1], "older") if items else Position(position.created_at, position.session_id).cursor()
    return records.RunsPage(items=items, next_cursor=older, prev_cursor=newer)


def read(
    conn: Connection, wanted: RunFilter, limit: int, position: Position | None, details: bool = False
) -> records.RunsPage:
    """A page of runs matching ``wanted``, from ``position``: one statement over ``runs`` alone.

    ``details`` adds each listed run's finish reason, step and usage, read from the documents of the page's rows
    only (one lookup each, after the page is chosen).
    """
    where, params = _where(wanted)
    params["limit"] = limit + 1
    order = "DESC"
    if position is not None:
        newer = position.direction == "newer"
        where.append(f"(created_at, session_id) {'>' if newer else '<'} (:at, :sid)")
        params.update(at=position.created_at, sid=position.session_id)
        order = "ASC" if newer else "DESC"
    clause = f"WHERE {' AND '.join(where)}" if where else ""
    page = f"SELECT {_COLUMNS} FROM runs {clause} ORDER BY created_at {order}, session_id {order} LIMIT :limit"
    if details:
        page = (
            f"SELECT p.*, {_DETAILS} FROM ({page}) p JOIN runs r ON r.session_id = p.session_id"
            f" ORDER BY p.created_at {order}, p.session_id {order}"
        )
    rows = conn.execute(text(page), params).all()
    found = [
        records.ListedRun(
            session_id=row.session_id,
            agent=row.agent,
            state=row.state,
            status=row.status,
            parent_id=row.parent_id,
            created_at=row.created_at,
            updated_at=row.updated_at,
            last_error=row.last_error,
            attempts=row.attempts,
            failures=row.failures,
            next_attempt_at=row.next_attempt_at,
            **(_details(row.finish_reason, row.step, row.usage) if details else {}),
        )
        for row in rows
    ]
    return page_of(found, limit, position)


def step_of(stored: Any) -> int | None:
    """A document's ``step`` as a listing shows it: None when it is not a whole number (a page never fails on one)."""
    return stored if isinstance(stored, int) and not isinstance(stored, bool) else None


def usage_of(stored: Any) -> records.Usage | None:
    """A document's ``usage`` as a listing shows it: the token counts it knows, None when it is not an object.

    Counts this release does not know (written by another) are left out rather than failing the page.
    """
    if not isinstance(stored, dict):
        return None
    known = {
        name: value
        for name, value in stored.items()
        if name in records.Usage.model_fields and isinstance(value, int) and not isinstance(value, bool)
    }
    return records.Usage(**known)


def _details(finish_reason: Any, step: Any, usage: Any) -> dict[str, Any]:
    return {
        "finish_reason": finish_reason if isinstance(finish_reason, str) else None,
        "step": step_of(step),
        "usage": usage_of(usage),
    }


def count(conn: Connection, wanted: RunFilter) -> dict[records.ListedState, int]:
    """How many runs matching ``wanted`` stand in each state (states with none left out): one statement."""
    where, params = _where(wanted)
    clause = f"WHERE {' AND '.join(where)}" if where else ""
    rows = conn.execute(
        text(
            f"SELECT state, count(*) AS n FROM (SELECT {STATE} AS state FROM runs {clause} OFFSET 0) s GROUP BY state"
        ),
        params,
    ).all()
    counted = {row.state: int(row.n) for row in rows}
    return {state: counted[state] for state in records.LISTED_STATES if state in counted}


def _where(wanted: RunFilter) -> tuple[list[str], dict[str, Any]]:
    """The SQL conditions and parameters of ``wanted``."""
    clauses: list[str] = []
    params: dict[str, Any] = {}
    if wanted.agents is not None:
        clauses.append("agent = ANY(:agents)")
        params["agents"] = sorted(wanted.agents)
    if wanted.states is not None:
        clauses.append(f"({STATE}) = ANY(:states)")
        params["states"] = sorted(wanted.states)
    if wanted.id_contains is not None:
        clauses.append("strpos(lower(session_id), lower(:search)) > 0")
        params["search"] = wanted.id_contains
    if wanted.since is not None:
        clauses.append("created_at >= :since")
        params["since"] = wanted.since
    return clauses, params


__all__ = [
    "MAX_LIMIT",
    "OWN_APPROVALS",
    "OWN_APPROVALS_PER_ROW",
    "STATE",
    "STATE_PER_ROW",
    "Position",
    "RunFilter",
    "check_limit",
    "count",
    "page_of",
    "parse_cursor",
    "read",
    "step_of",
    "usage_of",
]
