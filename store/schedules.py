"""Schedules in Postgres: their records, their tick arithmetic (cron with DST, or a fixed interval), and tick claims.

A tick is claimed by a ``schedule_fires`` row, unique per (schedule, fire time), in the same
transaction that creates its run, so any number of sweeps fire it once. Which ticks fire is
decided by the caller's planner (``worker.schedules``); this module must not publish messages.
A stored schedule whose ticks cannot be computed on this host is marked broken and skipped, never retried
by every sweep ahead of the healthy ones.
"""

from __future__ import annotations

import builtins
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError
from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator, model_validator
from sqlalchemy import Engine, text
from sqlalchemy.engine import Connection, Row

from store import errors, payloads, records, runs
from store.database import Transaction

Overlap = Literal["skip", "allow"]
CatchUp = Literal["skip", "one"]
Origin = Literal["api", "code"]
Outcome = Literal["fired", "skipped"]
#: Why a stored schedule's ticks cannot be computed; the stable prefix of its ``broken_error``.
BrokenReason = Literal[
    "timezone-unknown",  #: the host's time zone database has no such zone
    "cron-invalid",  #: the cron library rejects the stored expression
    "every-invalid",  #: the stored interval is not a positive number of seconds
    "tick-out-of-range",  #: a tick falls outside the years datetime arithmetic can hold
]

#: Run ids of schedule runs start with this: ``sched-<schedule_id>-<UTC fire time>``.
PREFIX = "sched-"
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,100}")
_MACROS = {
    "@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *", "@monthly": "0 0 1 * *", "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *", "@midnight": "0 0 * * *", "@hourly": "0 * * * *",
}
#: Candidates a cron iterator may yield before we give up looking for a later tick (DST repeats).
_MAX_CANDIDATES = 1000
#: The longest ``every`` accepted: 10 years of 365 days, in seconds. Far inside the ``integer``
#: column (2**31 - 1) and datetime's year 9999, so no accepted interval can overflow tick arithmetic.
MAX_EVERY_S = 10 * 365 * 86_400
#: Validation context of rows read back from Postgres: their timing is loaded as stored, not re-checked,
#: because whether it can be computed depends on the host (its tz database, its cron library). The sweep
#: finds out by computing ticks, and marks the schedule broken when it cannot.
_STORED = {"stored": True}

_COLUMNS = ("schedule_id, name, agent, input, cron, every_s, timezone, overlap, catch_up, paused, origin,"
            " next_fire_at, last_fire_at, last_session_id, created_at, updated_at, broken_error, broken_at")
_NOW = text("SELECT now()")
_INSERT = text(f"""
INSERT INTO schedules (name, agent, input, cron, every_s, timezone, overlap, catch_up, origin, next_fire_at)
VALUES (:name, :agent, CAST(:input AS jsonb), :cron, :every_s, :timezone, :overlap, :catch_up, :origin, :next)
ON CONFLICT (name) DO NOTHING RETURNING {_COLUMNS}
""")
_BY_NAME = text(f"SELECT {_COLUMNS} FROM schedules WHERE name = :name")
_LOCK_BY_NAME = text(f"SELECT {_COLUMNS} FROM schedules WHERE name = :name FOR UPDATE")
_LIST = text(f"SELECT {_COLUMNS} FROM schedules ORDER BY name")
_REDEFINE = text(f"""
UPDATE schedules SET agent = :agent, input = CAST(:input AS jsonb), cron = :cron, every_s = :every_s,
  timezone = :timezone, overlap = :overlap, catch_up = :catch_up, origin = :origin, next_fire_at = :next,
  broken_error = NULL, broken_at = NULL, updated_at = now()
WHERE name = :name RETURNING {_COLUMNS}
""")
_PAUSE = text(f"UPDATE schedules SET paused = true, updated_at = now() WHERE name = :name RETURNING {_COLUMNS}")
_RESUME = text(f"""
UPDATE schedules SET paused = false, next_fire_at = :next, broken_error = NULL, broken_at = NULL, updated_at = now()
WHERE name = :name RETURNING {_COLUMNS}
""")
_BREAK = text(f"""
UPDATE schedules SET broken_error = :error, broken_at = now(), updated_at = now() WHERE schedule_id = :id
RETURNING {_COLUMNS}
""")
_RESUME_BROKEN = text(f"""
UPDATE schedules SET paused = false, broken_error = :error, broken_at = now(), updated_at = now()
WHERE name = :name RETURNING {_COLUMNS}
""")
_DELETE = text("DELETE FROM schedules WHERE name = :name")
_FIRES = text("""
SELECT f.fire_at, f.session_id, f.outcome, f.claimed_at FROM schedule_fires f
JOIN schedules s ON s.schedule_id = f.schedule_id WHERE s.name = :name ORDER BY f.fire_at DESC LIMIT :limit
""")
# The most overdue healthy schedule nobody else is sweeping, with the database's time and whether the
# schedule's previous run is still active: waiting on a human's approval, or in progress or holding
# unread input while not parked. A parked run (its last error not retryable) waits for a human to fix
# and resume it, which may never happen: counting it as active would skip every later tick.
_LOCK_DUE = text(f"""
SELECT {", ".join("s." + c.strip() for c in _COLUMNS.split(","))}, now() AS db_now,
  COALESCE(r.status = 'awaiting-approval'
    OR ((r.status = 'in-progress' OR (r.status = 'finished' AND r.inbox_head > r.inbox_cursor))
        AND COALESCE(r.last_error ->> 'retryable', 'true') <> 'false'), false) AS previous_busy
FROM schedules s LEFT JOIN runs r ON r.session_id = s.last_session_id
WHERE NOT s.paused AND s.broken_error IS NULL AND s.next_fire_at <= now()
ORDER BY s.next_fire_at
LIMIT 1
FOR UPDATE OF s SKIP LOCKED
""")
_CLAIM_TICK = text("""
INSERT INTO schedule_fires (schedule_id, fire_at, session_id, outcome) VALUES (:id, :fire_at, :sid, :outcome)
ON CONFLICT (schedule_id, fire_at) DO NOTHING RETURNING fire_at
""")
_UNFIRE = text(
    "UPDATE schedule_fires SET outcome = 'skipped', session_id = NULL WHERE schedule_id = :id AND fire_at = :fire_at")
_ADVANCE = text("""
UPDATE schedules SET next_fire_at = :next, last_fire_at = COALESCE(:last_fire, last_fire_at),
  last_session_id = COALESCE(:last_sid, last_session_id), updated_at = now()
WHERE schedule_id = :id
""")


class ScheduleNotFoundError(errors.LoushoError):
    """No schedule has that name."""

    code = "LOUSHO_SCHEDULE_NOT_FOUND"

    def __init__(self, name: str) -> None:
        super().__init__(f"no schedule named {name!r}", name=name)


def _utc(value: datetime) -> datetime:
    if value.tzinfo is None:
        raise ValueError("timestamps must be timezone-aware")
    return value.astimezone(UTC)


class ScheduleBrokenError(errors.LoushoError):
    """A stored schedule's ticks cannot be computed on this host; raised by tick arithmetic.

    Its time zone is missing from this host's time zone database, the cron library rejects its
    expression, or its interval is out of range (a row written by hand, by another release, or
    checked on a host with a different tz database). The sweep stores ``str(error)`` as the
    schedule's ``broken_error`` and skips it until it is redefined or resumed.
    """

    code = "LOUSHO_SCHEDULE_BROKEN"
    name: str
    reason: BrokenReason

    def __init__(self, name: str, reason: BrokenReason, detail: str) -> None:
        super().__init__(f"{reason}: {detail}", name=name, reason=reason)


def _zone(name: str) -> ZoneInfo:
    """The zone ``name``; ``ValueError`` when this host cannot load it."""
    try:
        return ZoneInfo(name)
    # A directory of the database ("America") or an unreadable file is an OSError, not a lookup error.
    except (ZoneInfoNotFoundError, ValueError, OSError) as exc:
        raise ValueError(f"unknown time zone {name!r}") from exc


def _is_stored(info: ValidationInfo) -> bool:
    return isinstance(info.context, dict) and info.context.get("stored") is True


class ScheduleSpec(BaseModel):
    """What a schedule is: when it fires (``cron`` in ``timezone``, or ``every_s`` seconds) and what it sends.

    Interval ticks are aligned on the Unix epoch (``every_s=300`` fires at :00, :05, …), so a tick's
    identity never depends on when the schedule was created or swept. Cron ticks follow Debian
    cron across DST changes: a fixed-time job in the skipped hour fires right after the jump, one in
    the repeated hour fires once, and jobs with ``*`` in the hour field fire every real hour.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    agent: str
    messages: list[records.Message]
    cron: str | None = None
    every_s: int | None = None
    timezone: str = "UTC"
    overlap: Overlap = "skip"
    catch_up: CatchUp = "one"

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _NAME.fullmatch(value):
            raise ValueError("a schedule name is 1-100 of letters, digits, '_', '-' or '.'")
        return value

    @field_validator("agent")
    @classmethod
    def _agent(cls, value: str) -> str:
        if not value or len(value) > 200:
            raise ValueError("an agent name is 1-200 characters")
        return value

    @field_validator("cron")
    @classmethod
    def _cron(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None or _is_stored(info):
            return value
        expr = " ".join(value.split())
        expr = _MACROS.get(expr.lower(), expr)
        if len(expr.split()) != 5:
            raise ValueError("a cron expression has 5 fields (minute hour day month weekday) or is a @macro")
        try:
            next(CronSim(expr, datetime(2000, 1, 1, tzinfo=UTC)))
        except CronSimError as exc:
            raise ValueError(f"invalid cron expression: {exc}") from None
        return expr

    @field_validator("every_s")
    @classmethod
    def _every_s(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not _is_stored(info) and not 1 <= value <= MAX_EVERY_S:
            raise ValueError(f"every must be 1 to {MAX_EVERY_S} seconds (10 years)")
        return value

    @field_validator("timezone")
    @classmethod
    def _timezone(cls, value: str, info: ValidationInfo) -> str:
        if not _is_stored(info):
            _zone(value)
        return value

    @model_validator(mode="after")
    def _one_timing(self) -> ScheduleSpec:
        if (self.cron is None) == (self.every_s is None):
            raise ValueError("give exactly one of cron or every")
        if not self.messages:
            raise ValueError("a schedule needs some input")
        return self

    def next_tick(self, after: datetime) -> datetime:
        """The first tick strictly after ``after``, in UTC.

        Raises:
            ConfigurationError: the cron expression never matches again.
            ScheduleBrokenError: this host cannot compute the schedule's ticks (see ``BrokenReason``).
        """
        after = _utc(after)
        with self._arithmetic():
            if self.every_s is not None:
                step = self._step()
                return _EPOCH + ((after - _EPOCH) // step + 1) * step
            # Around a DST fall-back the iterator can yield a wall time that is earlier in real time.
            for _, candidate in zip(range(_MAX_CANDIDATES), self._cron_ticks(after), strict=False):
                tick = candidate.astimezone(UTC)
                if tick > after:
                    return tick
        raise errors.ConfigurationError(f"cron expression {self.cron!r} does not fire again")

    def last_tick(self, at: datetime) -> datetime | None:
        """The latest tick at or before ``at``, in UTC (None when there is none in 50 years).

        Raises:
            ScheduleBrokenError: this host cannot compute the schedule's ticks (see ``BrokenReason``).
        """
        at = _utc(at)
        with self._arithmetic():
            if self.every_s is not None:
                step = self._step()
                return _EPOCH + ((at - _EPOCH) // step) * step
            iterator = self._cron_ticks(at.replace(microsecond=0) + timedelta(seconds=1), reverse=True)
            found = None
            for _, candidate in zip(range(_MAX_CANDIDATES), iterator, strict=False):
                if candidate.astimezone(UTC) <= at:
                    found = candidate.astimezone(UTC)
                    break
        if found is None:
            return None
        # Backwards through a repeated (fall-back) hour the iterator can skip a tick: walk forward to the last.
        for _ in range(_MAX_CANDIDATES):
            following = self.next_tick(found)
            if following > at:
                break
            found = following
        return found

    def _step(self) -> timedelta:
        assert self.every_s is not None  # the caller checked
        if self.every_s < 1:
            raise ScheduleBrokenError(self.name, "every-invalid",
                                      f"every_s={self.every_s} is not a positive number of seconds")
        return timedelta(seconds=self.every_s)

    def _cron_ticks(self, start: datetime, reverse: bool = False) -> CronSim:
        assert self.cron is not None  # guaranteed by _one_timing
        try:
            zone = _zone(self.timezone)
        except ValueError as exc:
            raise ScheduleBrokenError(self.name, "timezone-unknown",
                                      f"time zone {self.timezone!r} is not in this host's time zone database") from exc
        try:
            return CronSim(self.cron, start.astimezone(zone), reverse=reverse)
        except CronSimError as exc:
            raise ScheduleBrokenError(self.name, "cron-invalid",
                                      f"cron expression {self.cron!r} is rejected: {exc}") from exc

    @contextmanager
    def _arithmetic(self) -> Iterator[None]:
        """Turn datetime overflow (an interval of millennia, a tick past year 9999) into a broken schedule."""
        try:
            yield
        except OverflowError as exc:
            raise ScheduleBrokenError(self.name, "tick-out-of-range",
                                      f"its ticks leave the years 1-9999 ({exc})") from exc

    def row(self, origin: Origin, next_fire_at: datetime) -> dict[str, Any]:
        """Bound parameters for inserting or redefining this schedule."""
        return {"name": self.name, "agent": self.agent, "input": payloads.dumps([m.dump() for m in self.messages]),
                "cron": self.cron, "every_s": self.every_s, "timezone": self.timezone, "overlap": self.overlap,
                "catch_up": self.catch_up, "origin": origin, "next": next_fire_at}

    def same_timing(self, other: ScheduleSpec) -> bool:
        """Whether ``other`` fires at the same ticks."""
        return (self.cron, self.every_s, self.timezone) == (other.cron, other.every_s, other.timezone)


class Schedule(ScheduleSpec):
    """A stored schedule: its spec plus its state.

    ``broken_error`` (with ``broken_at``, the database's time) is set when a sweep could not compute
    its ticks: ``<reason>: <detail>``, the reason one of ``BrokenReason``. Sweeps skip it until it is
    redefined or resumed.
    """

    schedule_id: int
    paused: bool = False
    origin: Origin = "api"
    next_fire_at: datetime
    last_fire_at: datetime | None = None
    last_session_id: str | None = None
    created_at: datetime | None = None
    updated_at: datetime | None = None
    broken_error: str | None = None
    broken_at: datetime | None = None

    def spec(self) -> ScheduleSpec:
        """The definition part, without state (taken as it is, like a stored row)."""
        return ScheduleSpec.model_validate(self.model_dump(include=set(ScheduleSpec.model_fields)), context=_STORED)


class Fire(BaseModel):
    """One claimed tick: ``fired`` started ``session_id``; ``skipped`` was claimed without a run (overlap)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    fire_at: datetime
    session_id: str | None
    outcome: Outcome
    claimed_at: datetime


@dataclass(frozen=True)
class TickPlan:
    """A planner's decision for one due schedule: ticks to fire, ticks to claim without a run, what is next."""

    fire: Sequence[datetime]
    skip: Sequence[datetime]
    next_fire_at: datetime
    #: Overdue ticks the catch-up policy dropped (not recorded).
    missed: int = 0


#: (schedule, the database's now, whether its previous run is unfinished) -> plan.
Planner = Callable[[Schedule, datetime, bool], TickPlan]


@dataclass(frozen=True)
class Swept:
    """What one locked schedule did: the runs it created (to enqueue after commit) and the rest.

    A ``schedule`` with ``broken_error`` set was marked broken by this sweep and did nothing else.
    """

    schedule: Schedule
    now: datetime
    fired: list[tuple[datetime, str]] = field(default_factory=list)
    skipped: list[datetime] = field(default_factory=list)
    missed: int = 0


def every_seconds(every: float | timedelta) -> int:
    """Whole seconds of an interval given as seconds or a ``timedelta``.

    Raises:
        ConfigurationError: not a whole number of seconds from 1 to ``MAX_EVERY_S`` (10 years).
    """
    seconds = every.total_seconds() if isinstance(every, timedelta) else every
    if (isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 1 <= seconds <= MAX_EVERY_S
            or seconds != int(seconds)):
        raise errors.ConfigurationError(f"every must be a whole number of seconds from 1 to {MAX_EVERY_S} (10 years),"
                                        f" got {every!r}", field="every")
    return int(seconds)


def build_spec(name: str, agent: str, messages: Sequence[records.Message], *, cron: str | None = None,
               every: float | timedelta | None = None, timezone: str = "UTC", overlap: Overlap = "skip",
               catch_up: CatchUp = "one") -> ScheduleSpec:
    """A checked ``ScheduleSpec``.

    Raises:
        ConfigurationError: a field is invalid (name, cron, time zone, ``every`` out of 1 s to 10 years,
            both or neither timing, policies); its ``field`` names it.
    """
    try:
        return ScheduleSpec(name=name, agent=agent, messages=list(messages), cron=cron,
                            every_s=None if every is None else every_seconds(every), timezone=timezone,
                            overlap=overlap, catch_up=catch_up)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise errors.ConfigurationError(f"invalid schedule {where or name!r}: {first['msg']}", field=where) from None


def tick_session_id(schedule_id: int, fire_at: datetime) -> str:
    """The run id of a tick: ``sched-<schedule_id>-<YYYYmmddTHHMMSSZ>`` (a valid run id)."""
    return records.validate_session_id(f"{PREFIX}{schedule_id}-{_utc(fire_at):%Y%m%dT%H%M%SZ}")


def _schedule(row: Row[Any]) -> Schedule:
    values = dict(row._mapping)
    values.pop("db_now", None)
    values.pop("previous_busy", None)
    values["messages"] = values.pop("input")
    return Schedule.model_validate(values, context=_STORED)


class PostgresScheduleStore:
    """Schedule definitions, their state, and the claim of their ticks."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def create(self, spec: ScheduleSpec, origin: Origin = "api") -> Schedule:
        """Store a new schedule; its first tick is the first one after the database's now.

        Raises:
            ConfigurationError: the name is taken.
        """
        with Transaction(self.engine) as conn:
            now: datetime = conn.execute(_NOW).scalar_one()
            row = conn.execute(_INSERT, spec.row(origin, spec.next_tick(now))).first()
        if row is None:
            raise errors.ConfigurationError(f"a schedule named {spec.name!r} exists already")
        return _schedule(row)

    def sync(self, spec: ScheduleSpec, origin: Origin = "code") -> Schedule:
        """Create ``spec`` or redefine the schedule of that name (declared in code; safe to run concurrently).

        Its paused state is kept; its next tick is recomputed only when its timing changed. A broken
        schedule is redefined and no longer broken (a sweep that still cannot compute its ticks marks
        it again); like a pause, ticks of the time it was broken are not fired.
        """
        with Transaction(self.engine) as conn:
            now: datetime = conn.execute(_NOW).scalar_one()
            row = conn.execute(_INSERT, spec.row(origin, spec.next_tick(now))).first()
            if row is not None:
                return _schedule(row)
            current = _schedule(conn.execute(_LOCK_BY_NAME, {"name": spec.name}).one())
            broken = current.broken_error is not None
            if current.spec() == spec and current.origin == origin and not broken:
                return current
            keep = current.spec().same_timing(spec) and not broken
            next_fire_at = current.next_fire_at if keep else spec.next_tick(now)
            return _schedule(conn.execute(_REDEFINE, spec.row(origin, next_fire_at)).one())

    def get(self, name: str) -> Schedule:
        """The schedule named ``name``.

        Raises:
            ScheduleNotFoundError: no such schedule.
        """
        with Transaction(self.engine) as conn:
            row = conn.execute(_BY_NAME, {"name": name}).first()
        if row is None:
            raise ScheduleNotFoundError(name)
        return _schedule(row)

    def list(self) -> builtins.list[Schedule]:
        """Every schedule, by name."""
        with Transaction(self.engine) as conn:
            return [_schedule(row) for row in conn.execute(_LIST)]

    def pause(self, name: str) -> Schedule:
        """Stop firing ``name`` until it is resumed.

        Raises:
            ScheduleNotFoundError: no such schedule.
        """
        with Transaction(self.engine) as conn:
            row = conn.execute(_PAUSE, {"name": name}).first()
        if row is None:
            raise ScheduleNotFoundError(name)
        return _schedule(row)

    def resume(self, name: str) -> Schedule:
        """Fire ``name`` again from its next tick after now (ticks of the pause are not fired).

        A broken schedule is tried again the same way (after the workers' time zone database or
        cron library was fixed): if its ticks still cannot be computed here, it stays broken with
        the new error and time, unpaused.

        Raises:
            ScheduleNotFoundError: no such schedule.
        """
        with Transaction(self.engine) as conn:
            row = conn.execute(_LOCK_BY_NAME, {"name": name}).first()
            if row is None:
                raise ScheduleNotFoundError(name)
            current = _schedule(row)
            if not current.paused and current.broken_error is None:
                return current
            now: datetime = conn.execute(_NOW).scalar_one()
            try:
                next_fire_at = current.next_tick(now)
            except ScheduleBrokenError as exc:
                return _schedule(conn.execute(_RESUME_BROKEN, {"name": name, "error": str(exc)}).one())
            return _schedule(conn.execute(_RESUME, {"name": name, "next": next_fire_at}).one())

    def delete(self, name: str) -> bool:
        """Drop the schedule and its tick claims (the runs it started stay); False when unknown."""
        with Transaction(self.engine) as conn:
            return bool(conn.execute(_DELETE, {"name": name}).rowcount)

    def fires(self, name: str, limit: int = 100) -> builtins.list[Fire]:
        """The schedule's claimed ticks, newest first."""
        with Transaction(self.engine) as conn:
            rows = conn.execute(_FIRES, {"name": name, "limit": limit}).all()
        return [Fire.model_validate(dict(row._mapping)) for row in rows]

    def fire_next_due(self, plan: Planner) -> Swept | None:
        """Lock the most overdue schedule no other sweep holds, and apply ``plan`` to it in one transaction.

        Each fired tick gets its claim row and its run (first input queued) in this transaction;
        a skipped tick gets its claim row only. Returns None when no schedule is due.

        When ``plan`` raises ``ScheduleBrokenError`` the schedule is marked broken instead, in the
        same transaction (nothing else of it was written), and returned with its ``broken_error``:
        later sweeps skip it, and the schedules behind it are swept as usual.

        Raises:
            ValueError: the plan does not move the schedule's next tick forward.
            StorageError: the database failed; nothing of this schedule was written.
        """
        with Transaction(self.engine) as conn:
            row = conn.execute(_LOCK_DUE).first()
            if row is None:
                return None
            schedule = _schedule(row)
            try:
                decision = plan(schedule, row.db_now, bool(row.previous_busy))
            except ScheduleBrokenError as exc:
                broken = _schedule(conn.execute(_BREAK, {"id": schedule.schedule_id, "error": str(exc)}).one())
                return Swept(broken, row.db_now)
            ticks = sorted({*decision.fire, *decision.skip})
            if decision.next_fire_at <= max([schedule.next_fire_at, *ticks]):
                raise ValueError("a tick plan must move next_fire_at past every tick it handles")
            swept = Swept(schedule, row.db_now, missed=decision.missed)
            firing = set(decision.fire)
            for tick in ticks:
                self._claim(conn, schedule, tick, tick in firing, swept)
            last_sid = swept.fired[-1][1] if swept.fired else None
            conn.execute(_ADVANCE, {"id": schedule.schedule_id, "next": decision.next_fire_at,
                                    "last_fire": ticks[-1] if ticks else None, "last_sid": last_sid})
        return swept

    @staticmethod
    def _claim(conn: Connection, schedule: Schedule, tick: datetime, fire: bool, swept: Swept) -> None:
        session_id = tick_session_id(schedule.schedule_id, tick) if fire else None
        claimed = conn.execute(_CLAIM_TICK, {"id": schedule.schedule_id, "fire_at": tick, "sid": session_id,
                                             "outcome": "fired" if fire else "skipped"}).first()
        if claimed is None:
            return  # claimed before (the row lock makes this rare): never a second run
        if session_id is None:
            swept.skipped.append(tick)
            return
        if runs.create_run(conn, session_id, schedule.agent, schedule.messages):
            swept.fired.append((tick, session_id))
        else:  # a run made by hand under this id: leave it alone, the tick is still claimed once
            conn.execute(_UNFIRE, {"id": schedule.schedule_id, "fire_at": tick})
            swept.skipped.append(tick)
