"""Tick arithmetic of schedules: cron read in a time zone (DST-aware) or a fixed interval, and tick run ids.

Pure: no SQL, no I/O, no clock. The records are ``store.schedule_records``; the Postgres store is ``store.schedules``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Protocol
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from store import errors, records

#: Run ids of schedule runs start with this: ``sched-<schedule_id>-<UTC fire time>``.
PREFIX = "sched-"
#: The longest ``every`` accepted: 10 years of 365 days, in seconds. Far inside the ``integer``
#: column (2**31 - 1) and datetime's year 9999, so no accepted interval can overflow tick arithmetic.
MAX_EVERY_S = 10 * 365 * 86_400
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MACROS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
#: Candidates a cron iterator may yield before we give up looking for a later tick (DST repeats).
_MAX_CANDIDATES = 1000


class Timing(Protocol):
    """When a schedule fires: ``cron`` read in ``timezone``, or every ``every_s`` seconds (exactly one is set)."""

    @property
    def name(self) -> str:
        """The schedule's name, for errors."""

    @property
    def cron(self) -> str | None:
        """A 5-field cron expression."""

    @property
    def every_s(self) -> int | None:
        """An interval in seconds, its ticks aligned on the Unix epoch."""

    @property
    def timezone(self) -> str:
        """The IANA zone ``cron`` is read in."""


def utc(value: datetime) -> datetime:
    """``value`` in UTC; ``ValueError`` when it is naive."""
    if value.tzinfo is None:
        raise ValueError("timestamps must be timezone-aware")
    return value.astimezone(UTC)


def zone(name: str) -> ZoneInfo:
    """The zone ``name``; ``ValueError`` when this host cannot load it."""
    try:
        return ZoneInfo(name)
    # A directory of the database ("America") or an unreadable file is an OSError, not a lookup error.
    except (ZoneInfoNotFoundError, ValueError, OSError) as exc:
        raise ValueError(f"unknown time zone {name!r}") from exc


def normalize_cron(value: str) -> str:
    """``value`` as 5 single-spaced fields (a ``@daily``-style macro expanded); ``ValueError`` when it is invalid."""
    expr = " ".join(value.split())
    expr = _MACROS.get(expr.lower(), expr)
    if len(expr.split()) != 5:
        raise ValueError("a cron expression has 5 fields (minute hour day month weekday) or is a @macro")
    try:
        next(CronSim(expr, datetime(2000, 1, 1, tzinfo=UTC)))
    except CronSimError as exc:
        raise ValueError(f"invalid cron expression: {exc}") from None
    return expr


def every_seconds(every: float | timedelta) -> int:
    """Whole seconds of an interval given as seconds or a ``timedelta``.

    Raises:
        ConfigurationError: not a whole number of seconds from 1 to ``MAX_EVERY_S`` (10 years).
    """
    seconds = every.total_seconds() if isinstance(every, timedelta) else every
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, int | float)
        or not 1 <= seconds <= MAX_EVERY_S
        or seconds != int(seconds)
    ):
        raise errors.ConfigurationError(
            f"every must be a whole number of seconds from 1 to {MAX_EVERY_S} (10 years), got {every!r}", field="every"
        )
    return int(seconds)


def next_tick(timing: Timing, after: datetime) -> datetime:
    """The first tick strictly after ``after``, in UTC.

    Raises:
        ConfigurationError: the cron expression never matches again.
        ScheduleBrokenError: this host cannot compute the schedule's ticks (see ``BrokenReason``).
    """
    after = utc(after)
    with _arithmetic(timing):
        if timing.every_s is not None:
            step = _step(timing)
            return _EPOCH + ((after - _EPOCH) // step + 1) * step
        # Around a DST fall-back the iterator can yield a wall time that is earlier in real time.
        for _, candidate in zip(range(_MAX_CANDIDATES), _cron_ticks(timing, after), strict=False):
            tick = candidate.astimezone(UTC)
            if tick > after:
                return tick
    raise errors.ConfigurationError(f"cron expression {timing.cron!r} does not fire again")


def last_tick(timing: Timing, at: datetime) -> datetime | None:
    """The latest tick at or before ``at``, in UTC (None when there is none in 50 years).

    Raises:
        ScheduleBrokenError: this host cannot compute the schedule's ticks (see ``BrokenReason``).
    """
    at = utc(at)
    with _arithmetic(timing):
        if timing.every_s is not None:
            step = _step(timing)
            return _EPOCH + ((at - _EPOCH) // step) * step
        iterator = _cron_ticks(timing, at.replace(microsecond=0) + timedelta(seconds=1), reverse=True)
        found = None
        for _, candidate in zip(range(_MAX_CANDIDATES), iterator, strict=False):
            if candidate.astimezone(UTC) <= at:
                found = candidate.astimezone(UTC)
                break
    if found is None:
        return None
    # Backwards through a repeated (fall-back) hour the iterator can skip a tick: walk forward to the last.
    for _ in range(_MAX_CANDIDATES):
        following = next_tick(timing, found)
        if following > at:
            break
        found = following
    return found


def count_ticks(timing: Timing, first: datetime, last: datetime, limit: int) -> int:
    """How many ticks lie in [``first``, ``last``] when ``first`` is a tick (a cron schedule's up to ``limit``).

    Raises:
        ScheduleBrokenError: this host cannot compute the schedule's ticks (see ``BrokenReason``).
    """
    if timing.every_s is not None:
        return int((last - first) // _step(timing)) + 1
    count, tick = 0, first
    while tick <= last and count < limit:
        count += 1
        try:
            tick = next_tick(timing, tick)
        except errors.ConfigurationError:  # the expression never matches again
            break
    return count


def tick_session_id(schedule_id: int, fire_at: datetime) -> str:
    """The run id of a tick: ``sched-<schedule_id>-<YYYYmmddTHHMMSSZ>`` (a valid run id).

    Raises:
        SessionIdInvalidError: never for a ``schedule_id`` the database hands out (a ``bigint``).
    """
    return records.validate_session_id(f"{PREFIX}{schedule_id}-{utc(fire_at):%Y%m%dT%H%M%SZ}")


def _step(timing: Timing) -> timedelta:
    assert timing.every_s is not None  # the caller checked
    if timing.every_s < 1:
        raise errors.ScheduleBrokenError(
            timing.name, "every-invalid", f"every_s={timing.every_s} is not a positive number of seconds"
        )
    return timedelta(seconds=timing.every_s)


def _cron_ticks(timing: Timing, start: datetime, reverse: bool = False) -> CronSim:
    assert timing.cron is not None  # exactly one timing is set
    try:
        local = zone(timing.timezone)
    except ValueError as exc:
        raise errors.ScheduleBrokenError(
            timing.name, "timezone-unknown", f"time zone {timing.timezone!r} is not in this host's time zone database"
        ) from exc
    try:
        return CronSim(timing.cron, start.astimezone(local), reverse=reverse)
    except CronSimError as exc:
        raise errors.ScheduleBrokenError(
            timing.name, "cron-invalid", f"cron expression {timing.cron!r} is rejected: {exc}"
        ) from exc


@contextmanager
def _arithmetic(timing: Timing) -> Iterator[None]:
    """Turn datetime overflow (an interval of millennia, a tick past year 9999) into a broken schedule."""
    try:
        yield
    except OverflowError as exc:
        raise errors.ScheduleBrokenError(
            timing.name, "tick-out-of-range", f"its ticks leave the years 1-9999 ({exc})"
        ) from exc
