"""Properties of the tick arithmetic: ticks move forward, are found exactly, never repeat, and survive DST."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from zoneinfo import ZoneInfo

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from store import records, ticks
from store.schedule_records import Schedule, ScheduleSpec, build_spec
from worker.schedules import plan_ticks

MSG = [records.Message(role="user", content="Send the report")]
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
TICK = timedelta(microseconds=1)
#: Zones whose clocks jump by a whole hour twice a year, and one without DST.
DST_ZONES = ["Europe/Berlin", "America/New_York"]
ZONES = [*DST_ZONES, "UTC"]
SLOW = settings(deadline=None, max_examples=60)


def _transitions(zone: str, years: range) -> list[datetime]:
    """The UTC hours in which ``zone``'s offset changes (its DST jumps), found by walking hour by hour."""
    local = ZoneInfo(zone)
    start, end = datetime(years.start, 1, 1, tzinfo=UTC), datetime(years.stop, 1, 1, tzinfo=UTC)
    found, hour = [], start
    while hour < end:
        following = hour + timedelta(hours=1)
        if hour.astimezone(local).utcoffset() != following.astimezone(local).utcoffset():
            found.append(following)
        hour = following
    return found


TRANSITIONS = {zone: _transitions(zone, range(2024, 2029)) for zone in DST_ZONES}


def instants(low: int = 1971, high: int = 2100) -> st.SearchStrategy[datetime]:
    return st.datetimes(min_value=datetime(low, 1, 1), max_value=datetime(high, 1, 1), timezones=st.just(UTC))


def near_transition(zone: str) -> st.SearchStrategy[datetime]:
    """Instants within a day and a half of one of ``zone``'s DST jumps, to the microsecond."""
    offsets = st.integers(-36 * 3_600_000_000, 36 * 3_600_000_000).map(lambda us: timedelta(microseconds=us))
    return st.builds(lambda at, offset: at + offset, st.sampled_from(TRANSITIONS[zone]), offsets)


def _field(low: int, high: int) -> st.SearchStrategy[str]:
    """A cron field: a value, a list, a range or a step, all inside [low, high]."""
    value = st.integers(low, high)
    return st.one_of(
        value.map(str),
        st.lists(value, min_size=1, max_size=3, unique=True).map(lambda vs: ",".join(map(str, sorted(vs)))),
        st.tuples(value, value).map(lambda ab: f"{min(ab)}-{max(ab)}"),
        st.integers(2, 30).map(lambda n: f"*/{n}"),
        st.just("*"),
    )


#: Expressions that fire at least daily, with the hours of the DST jumps (1-3 local) well covered.
DAILY_CRONS = st.builds(
    " ".join,
    st.tuples(
        _field(0, 59),
        _field(0, 23) | st.sampled_from(["1", "2", "3", "2,3"]),
        st.just("*"),
        st.just("*"),
        st.just("*") | st.just("MON-FRI"),
    ),
)
CRONS = DAILY_CRONS | st.sampled_from(["@hourly", "@daily", "@weekly", "@monthly", "0 0 29 2 *", "30 2 1 * *"])


def cron_spec(expr: str, zone: str) -> ScheduleSpec:
    return build_spec("s", "reporter", MSG, cron=expr, timezone=zone)


def every_spec(every_s: int) -> ScheduleSpec:
    return build_spec("s", "reporter", MSG, every=every_s)


@st.composite
def cron_and_instant(draw: st.DrawFn, crons: st.SearchStrategy[str] = CRONS) -> tuple[ScheduleSpec, datetime]:
    zone = draw(st.sampled_from(ZONES))
    at = draw(near_transition(zone) if zone in TRANSITIONS and draw(st.booleans()) else instants(2000, 2060))
    return cron_spec(draw(crons), zone), at


@st.composite
def jump_and_instant(draw: st.DrawFn) -> tuple[ScheduleSpec, datetime]:
    """A cron whose hour is the one a DST jump skips or repeats, and an instant within two hours of that jump."""
    zone = draw(st.sampled_from(DST_ZONES))
    jump = draw(st.sampled_from(TRANSITIONS[zone]))
    hour = (jump - timedelta(hours=1)).astimezone(ZoneInfo(zone)).hour  # the skipped or repeated wall hour
    minute = draw(st.integers(0, 59))
    expr = draw(
        st.sampled_from(
            [
                f"{minute} {hour} * * *",
                f"{minute} * * * *",
                f"{minute},59 {hour},{hour + 1} * * *",
                f"*/{draw(st.integers(2, 30))} {hour} * * *",
            ]
        )
    )
    at = jump + timedelta(microseconds=draw(st.integers(-2 * 3_600_000_000, 2 * 3_600_000_000)))
    return cron_spec(expr, zone), at


SPECS_AND_INSTANTS = (
    jump_and_instant()
    | cron_and_instant()
    | st.builds(lambda s, at: (every_spec(s), at), st.integers(1, ticks.MAX_EVERY_S), instants())
)


def run(spec: ScheduleSpec, start: datetime, until: datetime, limit: int = 5000) -> list[datetime]:
    """Ticks after ``start`` up to ``until``, by iterating ``next_tick`` as a sweep does."""
    out: list[datetime] = []
    tick = spec.next_tick(start)
    while tick <= until and len(out) < limit:
        out.append(tick)
        tick = spec.next_tick(tick)
    return out


# -- next_tick and last_tick -------------------------------------------------------------------


@SLOW
@given(SPECS_AND_INSTANTS)
def test_next_tick_is_the_first_tick_strictly_after(case: tuple[ScheduleSpec, datetime]) -> None:
    spec, after = case
    following = spec.next_tick(after)
    assert following > after and following.tzinfo == UTC
    # nothing fires in between: the latest tick before it is at or before ``after``
    before = spec.last_tick(following - TICK)
    assert before is None or before <= after


@SLOW
@given(SPECS_AND_INSTANTS, st.integers(0, 10**12).map(lambda us: timedelta(microseconds=us)))
def test_next_tick_never_goes_backwards_as_time_goes_forward(
    case: tuple[ScheduleSpec, datetime], later_by: timedelta
) -> None:
    spec, a = case
    assert spec.next_tick(a) <= spec.next_tick(a + later_by)


@SLOW
@given(SPECS_AND_INSTANTS)
def test_last_tick_is_the_latest_tick_at_or_before(case: tuple[ScheduleSpec, datetime]) -> None:
    spec, at = case
    latest = spec.last_tick(at)
    assert latest is not None and latest <= at
    # it is a tick, and the next one is after ``at``
    assert spec.next_tick(latest - TICK) == latest
    assert spec.next_tick(latest) > at


@SLOW
@given(SPECS_AND_INSTANTS)
def test_a_tick_is_its_own_last_tick(case: tuple[ScheduleSpec, datetime]) -> None:
    spec, after = case
    tick = spec.next_tick(after)
    assert spec.last_tick(tick) == tick


@given(st.integers(1, ticks.MAX_EVERY_S), instants())
@example(every_s=300, after=datetime(2026, 1, 1, 9, 5, tzinfo=UTC))
def test_interval_ticks_are_aligned_on_the_epoch_one_interval_apart(every_s: int, after: datetime) -> None:
    spec = every_spec(every_s)
    following = spec.next_tick(after)
    assert (following - EPOCH) % timedelta(seconds=every_s) == timedelta(0)
    assert following - after <= timedelta(seconds=every_s)
    assert spec.next_tick(following) - following == timedelta(seconds=every_s)
    assert spec.last_tick(after) == following - timedelta(seconds=every_s)


# -- fire once ---------------------------------------------------------------------------------


@SLOW
@given(SPECS_AND_INSTANTS)
def test_iterating_next_tick_never_yields_an_instant_twice(case: tuple[ScheduleSpec, datetime]) -> None:
    spec, start = case
    fired: list[datetime] = []
    tick = start
    for _ in range(50):
        tick = spec.next_tick(tick)
        fired.append(tick)
    assert fired == sorted(set(fired))
    assert len({ticks.tick_session_id(7, t) for t in fired}) == len(fired)


@SLOW
@given(SPECS_AND_INSTANTS, st.integers(0, 400))
def test_count_ticks_counts_what_iteration_fires(case: tuple[ScheduleSpec, datetime], steps: int) -> None:
    spec, start = case
    first = spec.next_tick(start)
    last = first
    for _ in range(steps):
        last = spec.next_tick(last)
    assert spec.count_ticks(first, last, limit=10_000) == steps + 1
    assert spec.count_ticks(first, spec.next_tick(last) - TICK, limit=10_000) == steps + 1


@SLOW
@given(SPECS_AND_INSTANTS, st.lists(st.integers(1, 900), min_size=1, max_size=20))
def test_sweeps_at_rising_times_handle_every_tick_once(case: tuple[ScheduleSpec, datetime], gaps: list[int]) -> None:
    # Given a schedule swept by beats whose periods are shorter than the grace
    spec, start = case
    grace = timedelta(seconds=max(gaps) + 1)
    schedule = Schedule.model_validate(
        {**spec.model_dump(), "schedule_id": 7, "next_fire_at": spec.next_tick(start), "overlap": "allow"}
    )
    first, now = schedule.next_fire_at, start
    handled: list[datetime] = []
    # When each sweep plans with the database time and the store stores its next tick
    for gap in gaps:
        now += timedelta(seconds=gap)
        if schedule.next_fire_at <= now:
            plan = plan_ticks(schedule, now, False, grace=grace, max_ticks=100_000)
            assert plan.skip == [] and plan.missed == 0
            handled.extend(plan.fire)
            schedule = schedule.model_copy(update={"next_fire_at": plan.next_fire_at})
    # Then every tick up to the last sweep fired exactly once, in order
    assert handled == run(spec, first - TICK, now, limit=100_000)


# -- DST ---------------------------------------------------------------------------------------


@settings(deadline=None, max_examples=300)
@given(jump_and_instant())
# after 01:30 EDT fired, from 01:15 EST (the hour again) the next 01:30 is tomorrow, not 01:30 EST
@example(case=(cron_spec("30 1 * * *", "America/New_York"), datetime(2026, 11, 1, 6, 15, tzinfo=UTC)))
# at 02:59:59 CEST (the first pass of the repeated hour) the last 02:00 is 02:00 CEST that same morning
@example(case=(cron_spec("0 2 * * *", "Europe/Berlin"), datetime(2024, 10, 27, 0, 59, 59, 999999, tzinfo=UTC)))
def test_around_a_dst_jump_the_last_and_next_ticks_are_neighbours(case: tuple[ScheduleSpec, datetime]) -> None:
    spec, at = case
    latest, following = spec.last_tick(at), spec.next_tick(at)
    assert latest is not None and latest <= at < following
    assert spec.next_tick(latest) == following


@SLOW
@given(st.sampled_from(DST_ZONES).flatmap(lambda z: st.tuples(st.just(z), near_transition(z))), CRONS)
def test_cron_ticks_across_a_dst_jump_only_move_forward(zone_and_start: tuple[str, datetime], expr: str) -> None:
    zone, start = zone_and_start
    fired = run(cron_spec(expr, zone), start, start + timedelta(days=3))
    assert all(a < b for a, b in pairwise(fired))


@SLOW
@given(
    st.sampled_from(DST_ZONES).flatmap(lambda z: st.tuples(st.just(z), near_transition(z))),
    st.integers(0, 59),
    st.integers(0, 4) | st.integers(0, 23),
)
def test_a_fixed_time_fires_once_each_local_day_across_dst_jumps(
    zone_and_start: tuple[str, datetime], minute: int, hour: int
) -> None:
    zone, start = zone_and_start
    local = ZoneInfo(zone)
    fired = run(cron_spec(f"{minute} {hour} * * *", zone), start, start + timedelta(days=4))
    days = [t.astimezone(local).date() for t in fired]
    if hour >= 4:  # far from the jumps (at 2 or 3 local), so the wall time is the one asked for
        assert {(t.astimezone(local).hour, t.astimezone(local).minute) for t in fired} == {(hour, minute)}
    # one tick per local day, none lost in the skipped hour, none doubled in the repeated one
    assert len(days) >= 3 and len(days) == len(set(days))
    assert all((b - a).days == 1 for a, b in pairwise(days))


@SLOW
@given(st.sampled_from(DST_ZONES).flatmap(lambda z: st.tuples(st.just(z), near_transition(z))), st.integers(0, 59))
def test_an_hourly_job_fires_every_real_hour_across_dst_jumps(
    zone_and_start: tuple[str, datetime], minute: int
) -> None:
    zone, start = zone_and_start
    fired = run(cron_spec(f"{minute} * * * *", zone), start, start + timedelta(days=2))
    assert len(fired) >= 47 and all(b - a == timedelta(hours=1) for a, b in pairwise(fired))


# -- tick run ids --------------------------------------------------------------------------------

_TICK_ID = re.compile(r"sched-(\d+)-(\d{8}T\d{6}Z)")


@given(st.integers(1, 2**63 - 1), instants(1971, 9998), st.sampled_from(ZONES))
def test_a_tick_run_id_is_valid_stable_and_names_schedule_and_second(
    schedule_id: int, fire_at: datetime, zone: str
) -> None:
    session_id = ticks.tick_session_id(schedule_id, fire_at)
    assert records.validate_session_id(session_id) == session_id
    # the same instant written in another zone names the same run
    assert ticks.tick_session_id(schedule_id, fire_at.astimezone(ZoneInfo(zone))) == session_id
    parsed = _TICK_ID.fullmatch(session_id)
    assert parsed is not None and int(parsed[1]) == schedule_id
    assert datetime.strptime(parsed[2], "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC) == fire_at.replace(microsecond=0)


def test_a_naive_time_has_no_tick_and_no_run_id() -> None:
    naive = datetime(2026, 1, 1, 9)
    with pytest.raises(ValueError, match="timezone-aware"):
        every_spec(60).next_tick(naive)
    with pytest.raises(ValueError, match="timezone-aware"):
        ticks.tick_session_id(1, naive)
