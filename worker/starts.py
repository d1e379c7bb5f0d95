"""Starting runs from Celery: the ``lousho.start`` task's rules, and beat entries whose ticks start one run each.

Any Celery app can start or continue a run by name, ``app.send_task("lousho.start", kwargs={...},
queue="<LOUSHO_QUEUE>-start")``, without importing this project. A message starts at most one run: without a
``session_id`` the run's id is made from the task id (a redelivered message finds its run), with one the task id
is the send's idempotency key.

Celery beat sends neither an entry's name nor the time of the tick it fires, so two beats (there are two during
every deploy) would each start a run for one tick. ``beat_entry`` builds entries that fire on a grid every beat
shares (whole multiples of the interval since the epoch, or cron minutes), and this module's publish hook stamps
the message with the time it was sent: the task rounds that to the tick, names the run after the entry and the
tick, and the second beat's message finds the run already started.
"""

from __future__ import annotations

import math
import re
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from celery import schedules

from store import errors, records

__all__ = ["START_TASK", "Every", "beat_entry", "run_id_for", "start_queue"]

#: The task's name: what ``send_task`` callers pass.
START_TASK = "lousho.start"
#: The message header the publish hook sets: when the message was sent (seconds since the epoch).
SENT_AT_HEADER = "lousho_sent_at"
_ENTRY_NAME = re.compile(r"[A-Za-z0-9_-]{1,100}")


def start_queue(queue: str) -> str:
    """The queue ``lousho.start`` messages go to, next to ``queue`` (``LOUSHO_QUEUE``)."""
    return f"{queue}-start"


class Every(schedules.schedule):  # type: ignore[misc]  # celery ships no type hints
    """An interval schedule on the epoch's grid: due at every whole multiple of ``seconds``, in every beat alike."""

    def __init__(self, seconds: float) -> None:
        if not seconds > 0:
            raise errors.ConfigurationError("a beat entry's interval must be a positive number of seconds")
        super().__init__(run_every=timedelta(seconds=seconds))
        self.every_s = float(seconds)

    def is_due(self, last_run_at: datetime) -> schedules.schedstate:
        """Due once the grid point after ``last_run_at`` has passed; next check at the following one."""
        now = self.now().timestamp()
        last = last_run_at.timestamp() if last_run_at.tzinfo else last_run_at.replace(tzinfo=UTC).timestamp()
        following = (math.floor(last / self.every_s) + 1) * self.every_s
        if now >= following:
            return schedules.schedstate(True, self.every_s - (now % self.every_s))
        return schedules.schedstate(False, following - now)

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.__class__, (self.every_s,))

    def __repr__(self) -> str:
        return f"<every {self.every_s:g} s on the epoch's grid>"


def beat_entry(
    name: str,
    agent: str,
    input: Any,
    schedule: float | schedules.crontab,
    *,
    queue: str = "lousho",
    metadata: dict[str, Any] | None = None,
    fairness_key: str | None = None,
) -> dict[str, Any]:
    """A ``beat_schedule`` entry that starts one run of ``agent`` per tick, however many beats send it.

    ``schedule`` is seconds (fired on the epoch's grid) or a ``crontab`` (at most one tick a minute). Each tick's
    run is ``<name>-<tick time, UTC, YYYYmmddTHHMMSS>``. ``queue`` is ``LOUSHO_QUEUE``. ``fairness_key`` is the runs'
    (as ``send``'s).

    Raises:
        ConfigurationError: the name is not 1-100 letters, digits, ``_`` or ``-``, or the schedule is neither.
    """
    if not isinstance(name, str) or not _ENTRY_NAME.fullmatch(name):
        raise errors.ConfigurationError(
            f"invalid beat entry name {str(name)[:80]!r}: use 1-100 letters, digits, '_' or '-'", field="name"
        )
    records.validate_agent_name(agent)
    if isinstance(schedule, schedules.crontab):
        fired, every_s = schedule, None
    elif isinstance(schedule, int | float) and not isinstance(schedule, bool):
        fired, every_s = Every(float(schedule)), float(schedule)
    else:
        raise errors.ConfigurationError("a beat entry's schedule is seconds or a crontab", field="schedule")
    return {
        "task": START_TASK,
        "schedule": fired,
        "kwargs": {
            "agent": agent,
            "input": input,
            "metadata": metadata,
            "beat_entry": name,
            "every_s": every_s,
            **({"fairness_key": fairness_key} if fairness_key is not None else {}),
        },
        "options": {"queue": start_queue(queue), "expires": 3600},
    }


def tick_of(sent_at: float, every_s: float | None) -> datetime:
    """The tick a beat message sent at ``sent_at`` fired for: its grid point, or its cron minute."""
    # A beat fires at or after the point on its own clock (the one that stamps the message); the half second
    # only absorbs a stamp a hair before it.
    if every_s:
        return datetime.fromtimestamp(math.floor((sent_at + 0.5) / every_s) * every_s, UTC)
    return datetime.fromtimestamp(math.floor((sent_at + 0.5) / 60) * 60, UTC)


def run_id_for(
    task_id: str, session_id: str | None, beat_entry: str | None, every_s: float | None, sent_at: float | None
) -> tuple[str, str]:
    """The run a ``lousho.start`` message starts or continues, and the idempotency key of its input.

    Raises:
        SessionIdInvalidError: a given ``session_id`` (or the one made) breaks the id rules.
    """
    if beat_entry is not None:
        tick = tick_of(sent_at if sent_at is not None else time.time(), every_s)
        run_id = f"{beat_entry}-{tick:%Y%m%dT%H%M%S}"
        return records.validate_session_id(run_id), f"tick-{tick:%Y%m%dT%H%M%S}"
    if session_id is not None:
        records.validate_session_id(session_id)
        if records.is_child_id(session_id):
            raise errors.SessionIdInvalidError(session_id, "ends with .task-<16 hex>, the mark of sub-agent runs")
        return session_id, f"celery-{task_id}"[:200]
    return records.validate_session_id(f"task-{task_id}"), f"celery-{task_id}"[:200]
