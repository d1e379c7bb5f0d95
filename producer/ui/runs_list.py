"""What the runs list shows beside its rows: the time filter it reads from a query, and its counts by state.

Turns a ``since`` query value into the creation time the store filters by, and the store's counts by state into
links that filter the list; it reads and writes nothing.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from store import records

#: The time windows the runs list offers, by query value: the runs created within that time before now.
WINDOWS: dict[str, tuple[str, timedelta]] = {
    "1h": ("Last hour", timedelta(hours=1)),
    "24h": ("Last 24 hours", timedelta(hours=24)),
    "7d": ("Last 7 days", timedelta(days=7)),
    "30d": ("Last 30 days", timedelta(days=30)),
}
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
    """One state's count on the runs list, with the link that lists the runs in that state."""

    state: str
    count: int
    href: str


def listing_link(kept: Mapping[str, str]) -> str:
    """The runs list with the filters of ``kept`` that are set."""
    query = urllib.parse.urlencode({name: value for name, value in kept.items() if value})
    return "/ui/runs" + (f"?{query}" if query else "")


def state_counts(counted: Mapping[records.ListedState, int], kept: Mapping[str, str]) -> list[StateCount]:
    """The counts by state the list shows, in the store's order, each linking to the list of that state.

    ``kept`` are the list's other filters (agent, id search, time), kept in each link.
    """
    return [StateCount(state, count, listing_link({**kept, "status": state})) for state, count in counted.items()]


__all__ = ["WINDOWS", "Since", "StateCount", "listing_link", "since_of", "state_counts"]
