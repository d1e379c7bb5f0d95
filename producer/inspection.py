"""What ``Client.runs`` and ``Client.describe`` answer: pages of run summaries, and one run explained.

Reads only: the listing comes from the store (``list_runs``, filtered and paged in SQL, no transcript read);
``describe`` adds what the run waits on and what moves it next, from ``store.observed`` and ``store.explain``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta

from sqlalchemy import Engine

from store import doctor, errors, explain, interfaces, observed, records, redis_client
from store.database import Transaction
from store.settings import Settings
from store.summaries import RunPage, RunSummary

#: Added to the wait before a second look, so the look comes after the time a suspect can be confirmed.
_CONFIRM_SLACK_S = 0.2
#: Most runs a page holds (the store's limit).
MAX_LIMIT = 500
#: A ``since`` given as text: a number and a unit (seconds, minutes, hours, days, weeks).
_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw])")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_since(value: str | None) -> datetime | timedelta | None:
    """A ``since`` given as text (``lousho runs --since``, ``GET /runs?since=``), as a duration or a time.

    A duration counts back from now (``90s``, ``30m``, ``6h``, ``2d``, ``1w``); a time is ISO-8601 (UTC when it
    has no offset).

    Raises:
        ConfigurationError: neither a duration nor a time.
    """
    if value is None:
        return None
    found = _DURATION.fullmatch(value.strip())
    if found:
        return timedelta(seconds=float(found.group(1)) * _UNITS[found.group(2)])
    try:
        when = datetime.fromisoformat(value.strip())
    except ValueError:
        raise errors.ConfigurationError(
            "since takes a duration (30m, 6h, 2d) or an ISO-8601 time", field="since"
        ) from None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def since_of(since: datetime | timedelta | None, now: datetime | None = None) -> datetime | None:
    """``since`` as a time: a ``timedelta`` counts back from now.

    Raises:
        ConfigurationError: a naive datetime, or a negative timedelta.
    """
    if isinstance(since, timedelta):
        if since < timedelta(0):
            raise errors.ConfigurationError("since must be a time or a positive timedelta", field="since")
        return (now or datetime.now(UTC)) - since
    if since is not None and (not isinstance(since, datetime) or since.tzinfo is None):
        raise errors.ConfigurationError("since must be a timezone-aware datetime or a timedelta", field="since")
    return since


def _names(value: str | Iterable[str] | None, field: str) -> list[str] | None:
    if value is None:
        return None
    names = [value] if isinstance(value, str) else list(value)
    if not all(isinstance(name, str) for name in names):
        raise errors.ConfigurationError(f"{field} takes a name or a list of names", field=field)
    return names


def runs(
    store: interfaces.ProducerStore,
    agent: str | Iterable[str] | None,
    state: str | Iterable[str] | None,
    since: datetime | timedelta | None,
    limit: int,
    cursor: str | None,
) -> RunPage:
    """A page of run summaries, newest first (see ``Client.runs``).

    Raises:
        ConfigurationError: an unknown state, a limit out of range, a cursor no page gave, a naive ``since``.
    """
    page = store.list_runs(
        agents=_names(agent, "agent"),
        states=_names(state, "state"),
        since=since_of(since),
        limit=limit,
        cursor=cursor,
        details=True,
    )
    return RunPage(
        items=[RunSummary.listed(run) for run in page.items], next_cursor=page.next_cursor, prev_cursor=page.prev_cursor
    )


def describe(
    engine: Engine, leases: redis_client.Client, broker_client: redis_client.Client, settings: Settings, session_id: str
) -> RunSummary | None:
    """Run ``session_id``'s summary with what it waits on and what moves it next; None for an unknown run.

    Raises:
        SessionIdInvalidError: the id breaks the id rules.
        StorageError: Postgres, Redis or the broker could not be read.
    """
    records.validate_session_id(session_id)
    with Transaction(engine) as conn:
        rows = observed.one(conn, session_id, settings)
        state = observed.business_state(conn, session_id) if rows else None
    if not rows:
        return None
    seen = observed.look(rows, leases, broker_client, settings)
    told = explain.explain(seen.observed[0], observed.grace(settings))
    summary = seen.summarized[0]
    # "waiting" is on children or on a model slot (DESIGN.md's vocabulary); the listing's state reads no Redis.
    waits = told.waiting_on.model_limit is not None and summary.state == "running"
    return summary.model_copy(
        update={
            "waiting_on": told.waiting_on,
            "next_action": told.next_action,
            "business_state": state,
            **({"state": "waiting"} if waits else {}),
        }
    )


def check(
    engine: Engine,
    leases: redis_client.Client,
    broker_client: redis_client.Client,
    settings: Settings,
    wait: bool = True,
) -> doctor.Report:
    """Look for unexplained runs (``store.doctor``); with ``wait``, look again once suspects can be confirmed.

    A run nothing explains at a first look is only a suspect: the second look, a sweep interval later, tells
    whether anything moved it. Without suspects (or without ``wait``) one look is all.

    Raises:
        StorageError: Postgres, Redis or the broker could not be read.
    """
    report = doctor.look(engine, leases, broker_client, settings)
    if wait and report.suspects and report.confirm_at is not None:
        pause = (report.confirm_at - report.looked_at).total_seconds()
        # One wait, bounded by a sweep interval: the second look confirms or clears every suspect of the first.
        time.sleep(min(max(pause, 0.0), settings.recover_interval_s) + _CONFIRM_SLACK_S)
        report = doctor.look(engine, leases, broker_client, settings)
    return report


__all__ = ["MAX_LIMIT", "check", "describe", "parse_since", "runs", "since_of"]
