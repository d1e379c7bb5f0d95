"""The Postgres schedule store: schedule definitions, their state, and the claim of their ticks.

A tick is claimed by a ``schedule_fires`` row, unique per (schedule, fire time), in the same
transaction that creates its run, so any number of sweeps fire it once. Which ticks fire is
decided by the caller's planner (``worker.schedules``); this module must not publish messages.
A stored schedule whose ticks cannot be computed on this host is marked broken and skipped, never retried
by every sweep ahead of the healthy ones. Records are ``store.schedule_records``, tick arithmetic ``store.ticks``.
"""

from __future__ import annotations

import builtins
from datetime import datetime
from typing import Any

from sqlalchemy import Engine, text
from sqlalchemy.engine import Connection, Row

from store import errors, payloads, runs
from store.database import Transaction
from store.errors import ScheduleBrokenError, ScheduleNotFoundError
from store.schedule_records import (
    Fire,
    Origin,
    Planner,
    Schedule,
    ScheduleSpec,
    Swept,
)
from store.ticks import tick_session_id

_COLUMNS = (
    "schedule_id, name, agent, input, cron, every_s, timezone, overlap, catch_up, paused, origin,"
    " next_fire_at, last_fire_at, last_session_id, created_at, updated_at, broken_error, broken_at,"
    " fairness_key"
)
_NOW = text("SELECT now()")
_INSERT = text(f"""
INSERT INTO schedules (name, agent, input, cron, every_s, timezone, overlap, catch_up, origin, next_fire_at,
  fairness_key)
VALUES (:name, :agent, CAST(:input AS jsonb), :cron, :every_s, :timezone, :overlap, :catch_up, :origin, :next,
  :fairness_key)
ON CONFLICT (name) DO NOTHING RETURNING {_COLUMNS}
""")
_BY_NAME = text(f"SELECT {_COLUMNS} FROM schedules WHERE name = :name")
_LOCK_BY_NAME = text(f"SELECT {_COLUMNS} FROM schedules WHERE name = :name FOR UPDATE")
_LIST = text(f"SELECT {_COLUMNS} FROM schedules ORDER BY name")
_REDEFINE = text(f"""
UPDATE schedules SET agent = :agent, input = CAST(:input AS jsonb), cron = :cron, every_s = :every_s,
  timezone = :timezone, overlap = :overlap, catch_up = :catch_up, origin = :origin, next_fire_at = :next,
  fairness_key = :fairness_key, broken_error = NULL, broken_at = NULL, updated_at = now()
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
    OR ({runs.has_work_sql("r")} AND {runs.not_parked_sql("r")}), false) AS previous_busy
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
    "UPDATE schedule_fires SET outcome = 'skipped', session_id = NULL WHERE schedule_id = :id AND fire_at = :fire_at"
)
_ADVANCE = text("""
UPDATE schedules SET next_fire_at = :next, last_fire_at = COALESCE(:last_fire, last_fire_at),
  last_session_id = COALESCE(:last_sid, last_session_id), updated_at = now()
WHERE schedule_id = :id
""")


def _params(spec: ScheduleSpec, origin: Origin, next_fire_at: datetime) -> dict[str, Any]:
    """Bound parameters for inserting or redefining ``spec``."""
    return {
        "name": spec.name,
        "agent": spec.agent,
        "input": payloads.dumps([m.dump() for m in spec.messages]),
        "cron": spec.cron,
        "every_s": spec.every_s,
        "timezone": spec.timezone,
        "overlap": spec.overlap,
        "catch_up": spec.catch_up,
        "origin": origin,
        "next": next_fire_at,
        "fairness_key": spec.fairness_key,
    }


def _schedule(row: Row[Any]) -> Schedule:
    values = dict(row._mapping)
    values.pop("db_now", None)
    values.pop("previous_busy", None)
    values["messages"] = values.pop("input")
    return Schedule.from_stored(values)


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
            row = conn.execute(_INSERT, _params(spec, origin, spec.next_tick(now))).first()
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
            row = conn.execute(_INSERT, _params(spec, origin, spec.next_tick(now))).first()
            if row is not None:
                return _schedule(row)
            current = _schedule(conn.execute(_LOCK_BY_NAME, {"name": spec.name}).one())
            broken = current.broken_error is not None
            if current.spec() == spec and current.origin == origin and not broken:
                return current
            keep = current.spec().same_timing(spec) and not broken
            next_fire_at = current.next_fire_at if keep else spec.next_tick(now)
            return _schedule(conn.execute(_REDEFINE, _params(spec, origin, next_fire_at)).one())

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
            conn.execute(
                _ADVANCE,
                {
                    "id": schedule.schedule_id,
                    "next": decision.next_fire_at,
                    "last_fire": ticks[-1] if ticks else None,
                    "last_sid": last_sid,
                },
            )
        return swept

    @staticmethod
    def _claim(conn: Connection, schedule: Schedule, tick: datetime, fire: bool, swept: Swept) -> None:
        session_id = tick_session_id(schedule.schedule_id, tick) if fire else None
        claimed = conn.execute(
            _CLAIM_TICK,
            {"id": schedule.schedule_id, "fire_at": tick, "sid": session_id, "outcome": "fired" if fire else "skipped"},
        ).first()
        if claimed is None:
            return  # claimed before (the row lock makes this rare): never a second run
        if session_id is None:
            swept.skipped.append(tick)
            return
        if runs.create_run(conn, session_id, schedule.agent, schedule.messages, fairness_key=schedule.fairness_key):
            swept.fired.append((tick, session_id))
        else:  # a run made by hand under this id: leave it alone, the tick is still claimed once
            conn.execute(_UNFIRE, {"id": schedule.schedule_id, "fire_at": tick})
            swept.skipped.append(tick)
