"""Tick arithmetic (intervals, cron, DST) and the sweep's planner; no services."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from store import errors, records
from store.schedule_records import Schedule, ScheduleSpec, Swept, build_spec
from store.settings import Settings, load_settings
from store.ticks import tick_session_id
from worker.schedules import NEVER, declare, plan_ticks, publish, sweep

MSG = [records.Message(role="user", content="Send the report")]
NY = ZoneInfo("America/New_York")


def utc(
    year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0, microsecond: int = 0
) -> datetime:
    return datetime(year, month, day, hour, minute, second, microsecond, tzinfo=UTC)


def spec(**timing: object) -> ScheduleSpec:
    return build_spec("s", "reporter", MSG, **timing)  # type: ignore[arg-type]


def schedule(next_fire_at: datetime, **fields: object) -> Schedule:
    base = spec(**{k: v for k, v in fields.items() if k in ("cron", "every", "timezone")} or {"every": 1})
    data = {**base.model_dump(), "schedule_id": 7, "next_fire_at": next_fire_at}
    data.update({k: v for k, v in fields.items() if k in ("overlap", "catch_up")})
    return Schedule.model_validate(data)


def ticks(s: ScheduleSpec, start: datetime, n: int) -> list[datetime]:
    out, tick = [], start
    for _ in range(n):
        tick = s.next_tick(tick)
        out.append(tick)
    return out


def test_interval_ticks_are_aligned_on_the_epoch_and_strictly_after() -> None:
    every5 = spec(every=5)
    assert every5.next_tick(utc(2026, 1, 1, 9, 0, 3)) == utc(2026, 1, 1, 9, 0, 5)
    assert every5.next_tick(utc(2026, 1, 1, 9, 0, 5)) == utc(2026, 1, 1, 9, 0, 10)
    assert every5.last_tick(utc(2026, 1, 1, 9, 0, 5)) == utc(2026, 1, 1, 9, 0, 5)
    assert every5.last_tick(utc(2026, 1, 1, 9, 0, 9, 999999)) == utc(2026, 1, 1, 9, 0, 5)
    assert spec(every=timedelta(hours=1)).next_tick(utc(2026, 1, 1, 9, 30)) == utc(2026, 1, 1, 10)


def test_cron_ticks_are_read_in_the_schedules_time_zone() -> None:
    nine = spec(cron="0 9 * * MON-FRI", timezone="Europe/Paris")
    assert ticks(nine, utc(2026, 1, 2, 12), 2) == [utc(2026, 1, 5, 8), utc(2026, 1, 6, 8)]  # Fri -> Mon, Tue
    assert nine.last_tick(utc(2026, 1, 5, 8)) == utc(2026, 1, 5, 8)
    assert nine.last_tick(utc(2026, 1, 5, 7, 59, 59)) == utc(2026, 1, 2, 8)
    assert spec(cron="@hourly").next_tick(utc(2026, 1, 1, 9, 0, 0, 1)) == utc(2026, 1, 1, 10)


def test_a_fixed_time_in_the_skipped_hour_fires_right_after_the_spring_forward() -> None:
    daily = spec(cron="30 2 * * *", timezone="America/New_York")
    local = [t.astimezone(NY).strftime("%m-%d %H:%M") for t in ticks(daily, utc(2026, 3, 7, 12), 3)]
    assert local == ["03-08 03:00", "03-09 02:30", "03-10 02:30"]


def test_a_fixed_time_in_the_repeated_hour_fires_once_on_the_fall_back() -> None:
    daily = spec(cron="30 1 * * *", timezone="America/New_York")
    fired = ticks(daily, utc(2026, 10, 31, 12), 3)
    assert fired == [utc(2026, 11, 1, 5, 30), utc(2026, 11, 2, 6, 30), utc(2026, 11, 3, 6, 30)]
    # Asked from inside the repeated hour (01:15 EST, after 01:30 EDT fired), the next one is tomorrow.
    assert daily.next_tick(utc(2026, 11, 1, 6, 15)) == utc(2026, 11, 2, 6, 30)
    assert daily.last_tick(utc(2026, 11, 1, 6, 15)) == utc(2026, 11, 1, 5, 30)


def test_an_hourly_job_fires_every_real_hour_through_the_fall_back() -> None:
    hourly = spec(cron="0 * * * *", timezone="America/New_York")
    fired = ticks(hourly, utc(2026, 11, 1, 4, 30), 4)
    assert fired == [utc(2026, 11, 1, 5), utc(2026, 11, 1, 6), utc(2026, 11, 1, 7), utc(2026, 11, 1, 8)]
    assert len({tick_session_id(1, t) for t in fired}) == 4


@pytest.mark.parametrize(
    "bad",
    [
        {},
        {"cron": "* * * * *", "every": 5},
        {"cron": "61 * * * *"},
        {"cron": "* * * *"},
        {"cron": "0 0 * * * *"},
        {"every": 0},
        {"every": 1.5},
        {"every": timedelta(milliseconds=500)},
        {"every": True},
        {"cron": "0 9 * * *", "timezone": "Mars/Olympus"},
    ],
)
def test_invalid_timings_are_configuration_errors(bad: dict[str, object]) -> None:
    with pytest.raises(errors.ConfigurationError):
        spec(**bad)


def test_names_and_inputs_are_checked() -> None:
    with pytest.raises(errors.ConfigurationError):
        build_spec("no spaces", "reporter", MSG, every=5)
    with pytest.raises(errors.ConfigurationError):
        build_spec("ok", "reporter", [], every=5)
    declared = declare("daily", "reporter", "Send it", cron="@daily", timezone="Europe/Paris")
    assert declared.cron == "0 0 * * *" and declared.messages[0].content == "Send it"


def test_tick_run_ids_are_valid_and_name_schedule_and_time() -> None:
    assert tick_session_id(42, utc(2026, 3, 8, 7)) == "sched-42-20260308T070000Z"
    records.validate_session_id(tick_session_id(2**62, utc(9999, 12, 31)))


def test_on_time_ticks_each_fire_once_and_the_next_tick_moves_past_them() -> None:
    s = schedule(utc(2026, 1, 1, 9, 0, 0), every=1, overlap="allow")
    plan = plan_ticks(s, utc(2026, 1, 1, 9, 0, 2, 500000), False)
    assert plan.fire == [utc(2026, 1, 1, 9, 0, 0), utc(2026, 1, 1, 9, 0, 1), utc(2026, 1, 1, 9, 0, 2)]
    assert plan.skip == [] and plan.next_fire_at == utc(2026, 1, 1, 9, 0, 3) and plan.missed == 0


def test_overlap_skip_fires_only_when_the_previous_run_is_done() -> None:
    s = schedule(utc(2026, 1, 1, 9), every=1, overlap="skip")
    busy = plan_ticks(s, utc(2026, 1, 1, 9, 0, 1), True)
    assert busy.fire == [] and busy.skip == [utc(2026, 1, 1, 9), utc(2026, 1, 1, 9, 0, 1)]
    idle = plan_ticks(s, utc(2026, 1, 1, 9, 0, 1), False)
    assert idle.fire == [utc(2026, 1, 1, 9)] and idle.skip == [utc(2026, 1, 1, 9, 0, 1)]


def test_after_downtime_catch_up_one_fires_the_latest_missed_tick_once() -> None:
    s = schedule(utc(2026, 1, 1, 9), cron="* * * * *", catch_up="one", overlap="allow")
    now = utc(2026, 1, 1, 9, 10, 30)  # ten minutes down, no tick within the grace
    plan = plan_ticks(s, now, False, grace=timedelta(seconds=5))
    assert plan.fire == [utc(2026, 1, 1, 9, 10)] and plan.missed == 10
    assert plan.next_fire_at == utc(2026, 1, 1, 9, 11)


def test_after_downtime_catch_up_skip_drops_missed_ticks() -> None:
    s = schedule(utc(2026, 1, 1, 9), cron="* * * * *", catch_up="skip", overlap="allow")
    plan = plan_ticks(s, utc(2026, 1, 1, 9, 10, 30), False, grace=timedelta(seconds=5))
    assert plan.fire == [] and plan.skip == [] and plan.missed == 11
    assert plan.next_fire_at == utc(2026, 1, 1, 9, 11)


def test_after_downtime_a_tick_within_the_grace_fires_itself_whatever_the_policy() -> None:
    for catch_up in ("skip", "one"):
        s = schedule(utc(2026, 1, 1, 9), cron="* * * * *", catch_up=catch_up, overlap="allow")
        plan = plan_ticks(s, utc(2026, 1, 1, 9, 10, 3), False, grace=timedelta(seconds=5))
        assert plan.fire == [utc(2026, 1, 1, 9, 10)] and plan.missed == 10


def test_a_long_backlog_is_handled_in_bounded_batches() -> None:
    s = schedule(utc(2026, 1, 1, 9), every=1, overlap="allow")
    plan = plan_ticks(s, utc(2026, 1, 1, 9, 0, 30), False, max_ticks=10)
    assert len(plan.fire) == 10 and plan.next_fire_at == utc(2026, 1, 1, 9, 0, 10)


def test_a_schedule_whose_next_tick_cannot_be_computed_waits_far_away(monkeypatch: pytest.MonkeyPatch) -> None:
    s = schedule(utc(2026, 1, 1), cron="0 0 1 1 *", overlap="allow")

    def never(self: ScheduleSpec, after: datetime) -> datetime:
        raise errors.ConfigurationError("no more ticks")

    monkeypatch.setattr(ScheduleSpec, "next_tick", never)
    plan = plan_ticks(s, utc(2026, 1, 1, 0, 0, 1), False)
    assert plan.fire == [utc(2026, 1, 1)] and plan.next_fire_at == NEVER


def test_the_schedule_grace_comes_from_settings_and_is_at_least_three_periods(monkeypatch: pytest.MonkeyPatch) -> None:
    assert (Settings().schedule_interval_s, Settings().schedule_grace) == (5.0, timedelta(seconds=60))
    assert Settings(schedule_interval_s=1, schedule_grace_s=2).schedule_grace == timedelta(seconds=3)
    assert Settings(schedule_interval_s=30).schedule_grace == timedelta(seconds=90)
    for variable, bad in (
        ("LOUSHO_SCHEDULE_INTERVAL_S", "0"),
        ("LOUSHO_SCHEDULE_GRACE_S", "soon"),
        ("LOUSHO_SCHEDULE_GRACE_S", "-1"),
    ):
        monkeypatch.setenv(variable, bad)
        with pytest.raises(errors.ConfigurationError):
            load_settings()
        monkeypatch.delenv(variable)


def test_a_sweep_that_loses_the_database_midway_still_returns_what_it_committed() -> None:
    committed = Swept(
        schedule(utc(2026, 1, 1), every=1),
        utc(2026, 1, 1, 0, 0, 1),
        fired=[(utc(2026, 1, 1), "sched-7-20260101T000000Z")],
    )

    class FailingStore:
        calls = 0

        def fire_next_due(self, plan: object) -> Swept | None:
            self.calls += 1
            if self.calls == 1:
                return committed
            raise errors.StorageError("database unavailable: OperationalError")

    result = sweep(FailingStore(), grace=timedelta(seconds=60))  # type: ignore[arg-type]  # a fake store
    assert result.interrupted and result.session_ids == ["sched-7-20260101T000000Z"]
    sent: list[str] = []
    assert publish(result, sent.append) == 1 and sent == result.session_ids
