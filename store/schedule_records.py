"""Schedule records: a schedule's definition and its checks (``ScheduleSpec``), its stored state, its claimed ticks.

Pure: no SQL, no I/O. The tick arithmetic is ``store.ticks``; the Postgres store is ``store.schedules``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator, model_validator

from store import errors, model_limit, records, ticks

Overlap = Literal["skip", "allow"]
CatchUp = Literal["skip", "one"]
Origin = Literal["api", "code"]
#: What became of a claimed tick.
TickOutcome = Literal[
    "fired",  #: the tick started its run
    "skipped",  #: the tick was claimed without a run (overlap, or a run of that id existed)
]

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,100}")
#: Validation context of stored rows: their timing is loaded as stored, not re-checked, because
#: whether it can be computed depends on the host (its tz database, its cron library). The sweep
#: finds out by computing ticks, and the store marks the schedule broken when it cannot.
_STORED = {"stored": True}


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
    #: The fairness key of the runs it starts (``send(..., fairness_key=...)``); None: none.
    fairness_key: str | None = None

    @field_validator("fairness_key")
    @classmethod
    def _fairness_key(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                model_limit.validate_fairness_key(value)
            except errors.ConfigurationError as exc:
                raise ValueError(str(exc)) from None
        return value

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
        return ticks.normalize_cron(value)

    @field_validator("every_s")
    @classmethod
    def _every_s(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not _is_stored(info) and not 1 <= value <= ticks.MAX_EVERY_S:
            raise ValueError(f"every must be 1 to {ticks.MAX_EVERY_S} seconds (10 years)")
        return value

    @field_validator("timezone")
    @classmethod
    def _timezone(cls, value: str, info: ValidationInfo) -> str:
        if not _is_stored(info):
            ticks.zone(value)
        return value

    @model_validator(mode="after")
    def _one_timing(self) -> ScheduleSpec:
        if (self.cron is None) == (self.every_s is None):
            raise ValueError("give exactly one of cron or every")
        if not self.messages:
            raise ValueError("a schedule needs some input")
        return self

    def next_tick(self, after: datetime) -> datetime:
        """The first tick strictly after ``after``, in UTC (see ``store.ticks.next_tick``).

        Raises:
            ConfigurationError: the cron expression never matches again.
            ScheduleBrokenError: this host cannot compute the schedule's ticks (see ``BrokenReason``).
        """
        return ticks.next_tick(self, after)

    def last_tick(self, at: datetime) -> datetime | None:
        """The latest tick at or before ``at``, in UTC (None when there is none in 50 years).

        Raises:
            ScheduleBrokenError: this host cannot compute the schedule's ticks (see ``BrokenReason``).
        """
        return ticks.last_tick(self, at)

    def count_ticks(self, first: datetime, last: datetime, limit: int) -> int:
        """How many ticks lie in [``first``, ``last``] when ``first`` is a tick (a cron schedule's up to ``limit``).

        Raises:
            ScheduleBrokenError: this host cannot compute the schedule's ticks (see ``BrokenReason``).
        """
        return ticks.count_ticks(self, first, last, limit)

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

    @classmethod
    def from_stored(cls, values: dict[str, Any]) -> Schedule:
        """A schedule from its stored fields, its timing taken as stored (not re-checked on this host)."""
        return cls.model_validate(values, context=_STORED)

    def spec(self) -> ScheduleSpec:
        """The definition part, without state (taken as it is, like a stored row)."""
        return ScheduleSpec.model_validate(self.model_dump(include=set(ScheduleSpec.model_fields)), context=_STORED)


class Fire(BaseModel):
    """One claimed tick: ``fired`` started ``session_id``; ``skipped`` was claimed without a run (overlap)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    fire_at: datetime
    session_id: str | None
    outcome: TickOutcome
    claimed_at: datetime


@dataclass(frozen=True)
class TickPlan:
    """A planner's decision for one due schedule: ticks to fire, ticks to claim without a run, what is next."""

    fire: Sequence[datetime]
    skip: Sequence[datetime]
    next_fire_at: datetime
    #: Overdue ticks the catch-up policy dropped (not recorded).
    missed: int = 0


def build_spec(
    name: str,
    agent: str,
    messages: Sequence[records.Message],
    *,
    cron: str | None = None,
    every: float | timedelta | None = None,
    timezone: str = "UTC",
    overlap: Overlap = "skip",
    catch_up: CatchUp = "one",
    fairness_key: str | None = None,
) -> ScheduleSpec:
    """A checked ``ScheduleSpec``.

    Raises:
        ConfigurationError: a field is invalid (name, cron, time zone, ``every`` out of 1 s to 10 years,
            both or neither timing, policies); its ``field`` names it.
    """
    try:
        return ScheduleSpec(
            name=name,
            agent=agent,
            messages=list(messages),
            cron=cron,
            every_s=None if every is None else ticks.every_seconds(every),
            timezone=timezone,
            overlap=overlap,
            catch_up=catch_up,
            fairness_key=fairness_key,
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise errors.ConfigurationError(f"invalid schedule {where or name!r}: {first['msg']}", field=where) from None


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
