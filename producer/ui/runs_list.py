"""What the runs list shows beside its rows: the time filter it reads from a query, and its counts by state.

Turns a ``since`` query value into the creation time the store filters by, and the store's counts by state into
links that filter the list; it reads and writes nothing.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from producer.ui import views

#: The time windows the runs list offers, by query value: the runs created within that time before now.
WINDOWS: dict[str, tuple[str, timedelta]] = {
    "1h": ("Last hour", timedelta(hours=1)), "24h": ("Last 24 hours", timedelta(hours=24)),
    "7d": ("Last 7 days", timedelta(days=7)), "30d": ("Last 30 days", timedelta(days=30))}
#: Longest ``since`` value read (an ISO-8601 time with microseconds and an offset fits well within it).
_MAX_SINCE = 40


@dataclass(frozen=True)
class Since:
    """The list's time filter: the query value kept in links, what the form shows for it, and the time it stands for.

    ``at`` is None (no filter) for an empty or unreadable value.
    """

    value: str = ""
    label: str = ""
    at: datetime | None = None


def since_of(value: str, now: datetime) -> Since:
    """The time filter a ``since`` query value asks for: a window (``WINDOWS``) before ``now``, or a time.

    A time is ISO-8601 with its offset (``Z`` for UTC); a time without an offset, or anything else, is no filter.
    """
    value = value.strip()[:_MAX_SINCE]
    if value in WINDOWS:
        label, width = WINDOWS[value]
        return Since(value, label, now - width)
    try:
        at = datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None
    except ValueError:
        at = None
    if at is None or at.tzinfo is None:
        return Since()
    return Since(value, "since " + at.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"), at)


@dataclass(frozen=True)
class StateCount:
    """One state's count on the runs list, with the link that lists those runs."""

    #: The state as the store names it.
    state: str
    #: What the page calls it.
    word: str
    count: int
    href: str


def _word_and_filter(state: str) -> tuple[str, str]:
    """What the page calls ``state``, and the status filter of the list that keeps it.

    The word is the filter that keeps this state alone, else the state itself; the filter, the first that keeps it.
    """
    keeping = [status for status in views.STATUSES if status and state in (views.states_of(status) or ())]
    alone = [status for status in keeping if tuple(views.states_of(status) or ()) == (state,)]
    return (alone[0] if alone else state), (keeping[0] if keeping else "")


def state_counts(counted: Mapping[str, int], kept: Mapping[str, str]) -> list[StateCount]:
    """The counts by state the list shows, in the store's order, each linking to the list of that state.

    ``kept`` are the list's other filters (agent, id search, time), kept in each link.
    """
    found = []
    for state, count in counted.items():
        word, status = _word_and_filter(state)
        query = {**{k: v for k, v in kept.items() if v}, **({"status": status} if status else {})}
        found.append(StateCount(state, word, count, "/ui/runs?" + urllib.parse.urlencode(query)))
    return found


__all__ = ["WINDOWS", "Since", "StateCount", "since_of", "state_counts"]
