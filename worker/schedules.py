"""The schedule sweep: which due ticks fire, are claimed without a run, or are dropped; and the sweep loop.

Framework-free (no Celery): the beat task in ``worker.tasks`` calls ``sweep`` and then ``publish``.
Tick claims and runs are committed by ``store.schedules`` in one transaction per schedule; nothing
here publishes before that commit, and nothing here reads a worker clock: "now" is Postgres's.
A schedule whose ticks cannot be computed is marked broken by the store and skipped; it never stops the others.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from store import errors, inputs
from store.faults import crash_point
from store.schedule_records import CatchUp, Overlap, Schedule, ScheduleSpec, TickPlan, build_spec
from store.schedules import PostgresScheduleStore
from worker.agents import import_agent_modules

log = logging.getLogger("lousho.schedules")

#: How late a tick may be and still fire as itself; older ticks follow the schedule's catch-up policy.
DEFAULT_GRACE = timedelta(seconds=60)
#: Ticks handled per schedule per transaction; a schedule with more due ticks is taken again at once.
MAX_TICKS = 1000
#: Schedules handled per sweep.
MAX_SCHEDULES = 500
#: The next tick of a cron expression that never matches again.
NEVER = datetime(9999, 12, 31, tzinfo=UTC)
_JUST_BEFORE = timedelta(microseconds=1)
_MAX_COUNTED = 10_000


def _next_or_never(schedule: Schedule, after: datetime) -> datetime:
    try:
        return schedule.next_tick(after)
    except errors.ConfigurationError:
        log.warning("schedule %s never fires again; it stays idle until redefined", schedule.name)
        return NEVER


def plan_ticks(
    schedule: Schedule,
    now: datetime,
    previous_busy: bool,
    *,
    grace: timedelta = DEFAULT_GRACE,
    max_ticks: int = MAX_TICKS,
) -> TickPlan:
    """Decide what happens to the due ticks of ``schedule`` at the database time ``now``.

    Ticks no older than ``grace`` are on time and each is handled once. Older ones (downtime,
    a stopped beat) follow ``catch_up``: ``skip`` drops them, ``one`` fires the latest of them when
    no on-time tick is due. Then ``overlap``: ``allow`` fires every chosen tick; ``skip`` fires the
    first one only when the schedule's previous run is not active, and claims the others without a run.

    Raises:
        ScheduleBrokenError: the schedule's ticks cannot be computed on this host (the store marks it broken).
    """
    cutoff = now - grace
    first = schedule.next_fire_at
    latest_late: datetime | None = None
    missed = 0
    if first < cutoff:
        latest_late = schedule.last_tick(cutoff - _JUST_BEFORE)
        if latest_late is not None and latest_late < first:
            latest_late = None
        if latest_late is not None:
            missed = schedule.count_ticks(first, latest_late, _MAX_COUNTED)  # only for logs and figures
        tick = _next_or_never(schedule, cutoff - _JUST_BEFORE)
    else:
        tick = first
    chosen: list[datetime] = []
    while tick <= now and len(chosen) < max_ticks:
        chosen.append(tick)
        tick = _next_or_never(schedule, tick)
    if latest_late is not None and schedule.catch_up == "one" and not chosen:
        chosen, missed = [latest_late], missed - 1
    if schedule.overlap == "allow":
        fire, skip = chosen, []
    elif previous_busy:
        fire, skip = [], chosen
    else:
        fire, skip = chosen[:1], chosen[1:]
    return TickPlan(fire=fire, skip=skip, next_fire_at=tick, missed=missed)


@dataclass
class SweepResult:
    """What one sweep did; ``fired`` lists (schedule name, tick, run id) to enqueue, in claim order."""

    fired: list[tuple[str, datetime, str]] = field(default_factory=list)
    skipped: int = 0
    missed: int = 0
    schedules: int = 0
    #: The agent of each run started, so its step goes to that agent's queue.
    agents: dict[str, str] = field(default_factory=dict)
    #: Names of the schedules this sweep marked broken (their ticks cannot be computed; later sweeps skip them).
    broken: list[str] = field(default_factory=list)
    now: datetime | None = None
    #: The database failed midway; what is listed was committed and must still be published.
    interrupted: bool = False

    @property
    def session_ids(self) -> list[str]:
        """The runs to enqueue."""
        return [session_id for _, _, session_id in self.fired]


def sweep(
    store: PostgresScheduleStore, *, grace: timedelta = DEFAULT_GRACE, max_schedules: int = MAX_SCHEDULES
) -> SweepResult:
    """Fire every due tick of every schedule once; safe to run from any number of beats at once.

    Each due schedule is locked (others skip it), its ticks claimed and its runs created in one
    transaction. Publish the returned runs with ``publish`` afterwards; a lost publish is repaired
    by the recover sweep, because the run is in progress with queued input.

    When the database fails midway the sweep stops and returns what it committed so far (with
    ``interrupted`` set), so those runs are still published; the next sweep goes on. A schedule
    whose ticks cannot be computed is marked broken (listed in ``broken``) and the sweep goes on.
    """
    result = SweepResult()
    planner = functools.partial(plan_ticks, grace=grace)
    for _ in range(max_schedules):
        try:
            swept = store.fire_next_due(planner)
        except errors.StorageError as exc:
            log.warning("schedule sweep stopped: %s", exc.message)
            result.interrupted = True
            break
        if swept is None:
            break
        result.schedules += 1
        result.now = swept.now
        if swept.schedule.broken_error is not None:
            result.broken.append(swept.schedule.name)
            log.error(
                "schedule %s is broken and skipped until it is redefined or resumed: %s",
                swept.schedule.name,
                swept.schedule.broken_error,
            )
            continue
        result.fired.extend((swept.schedule.name, tick, sid) for tick, sid in swept.fired)
        result.agents.update((sid, swept.schedule.agent) for _, sid in swept.fired)
        result.skipped += len(swept.skipped)
        result.missed += swept.missed
        if swept.missed:
            log.info(
                "schedule %s: %d overdue tick(s) dropped by catch_up=%s",
                swept.schedule.name,
                swept.missed,
                swept.schedule.catch_up,
            )
    return result


def publish(result: SweepResult, enqueue: Callable[[str], None]) -> int:
    """Enqueue ``advance`` for every run the sweep created; returns how many were sent.

    ``enqueue`` gets the run id; ``result.agents`` says whose queue it belongs on.
    """
    for session_id in result.session_ids:
        crash_point("tick_claim_before_publish", session_id)
        enqueue(session_id)
    return len(result.fired)


def declare(
    name: str,
    agent: str,
    input: inputs.Input,
    *,
    cron: str | None = None,
    every: float | timedelta | None = None,
    timezone: str = "UTC",
    overlap: Overlap = "skip",
    catch_up: CatchUp = "one",
    fairness_key: str | None = None,
) -> ScheduleSpec:
    """A schedule declared in code, next to its agent; workers sync it at start (see ``sync_declared``).

    ``fairness_key``: the runs it starts share contended model slots round-robin with other keys' runs.

    Raises:
        ConfigurationError: an invalid field, or input that is not a string or chat messages.
        InputTooLargeError: the input is too large or nests too deeply (the limits of ``store.inputs``).
    """
    try:
        messages = inputs.normalize_input(input)
    except errors.ConfigurationError as exc:
        raise errors.ConfigurationError(f"schedule {name!r}: {exc}") from exc
    return build_spec(
        name,
        agent,
        messages,
        cron=cron,
        every=every,
        timezone=timezone,
        overlap=overlap,
        catch_up=catch_up,
        fairness_key=fairness_key,
    )


def declared_schedules(modules: Iterable[str]) -> list[ScheduleSpec]:
    """The ``ScheduleSpec`` objects defined at the top level of ``modules`` (the agent modules).

    Raises:
        ConfigurationError: a module cannot be imported, or two different schedules share a name.
    """
    found: dict[str, ScheduleSpec] = {}
    for module in import_agent_modules(modules):
        for value in vars(module).values():
            if isinstance(value, ScheduleSpec) and not isinstance(value, Schedule):
                other = found.setdefault(value.name, value)
                if other != value:
                    raise errors.ConfigurationError(f"two schedules are named {value.name!r}")
    return list(found.values())


def sync_declared(store: PostgresScheduleStore, modules: Iterable[str]) -> list[Schedule]:
    """Create or redefine the schedules declared in ``modules``; a paused one stays paused.

    Schedules removed from code are left in place (delete them with ``lousho schedules delete``):
    workers of one deployment may run different module lists.

    Raises:
        ConfigurationError: see ``declared_schedules``.
        StorageError: the database failed.
    """
    return [store.sync(spec, origin="code") for spec in declared_schedules(modules)]
