"""Schedules on the real database: the producer API and CLI, the sweep's claims, overlap and catch-up, code sync."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from datetime import datetime, timedelta

import pytest
from sqlalchemy import text

from producer.cli import schedules as schedule_cli
from producer.schedules import Schedules
from store import errors
from store.checkpoints import PostgresCheckpointStore
from store.schedule_records import Schedule, TickPlan
from store.schedules import PostgresScheduleStore
from worker.schedules import SweepResult, declare, publish, sweep, sync_declared

pytestmark = pytest.mark.integration

GRACE = timedelta(seconds=60)


def _db_now(store: PostgresScheduleStore) -> datetime:
    with store.engine.connect() as conn:
        now: datetime = conn.execute(text("SELECT now()")).scalar_one()
    return now


def _wait_for_tick(store: PostgresScheduleStore, name: str) -> None:
    """Sleep until the schedule's next tick has passed on the database's clock."""
    due = store.get(name).next_fire_at
    time.sleep(max(0.0, (due - _db_now(store)).total_seconds()) + 0.05)


def _seconds_after(tick: datetime, until: datetime) -> list[datetime]:
    """The whole seconds after ``tick`` up to ``until``: the ticks of an every-1-second schedule due since ``tick``."""
    ticks, tick = [], tick + timedelta(seconds=1)
    while tick <= until:
        ticks.append(tick)
        tick += timedelta(seconds=1)
    return ticks


def _sweep(store: PostgresScheduleStore, **kw: object) -> SweepResult:
    return sweep(store, **kw)  # type: ignore[arg-type]


def test_create_list_pause_resume_delete(schedules: Schedules) -> None:
    made = schedules.create("report", "reporter", "Send the report", cron="0 9 * * *", timezone="Europe/Paris")
    assert made.schedule_id > 0 and made.paused is False and made.next_fire_at.tzinfo is not None
    assert made.next_fire_at.astimezone().utcoffset() is not None
    assert [s.name for s in schedules.list()] == ["report"]
    with pytest.raises(errors.ConfigurationError):
        schedules.create("report", "reporter", "again", every=60)
    with pytest.raises(errors.AgentNotFoundError):
        schedules.create("other", "nobody", "hi", every=60)
    assert schedules.pause("report").paused is True
    resumed = schedules.resume("report")
    assert resumed.paused is False and resumed.next_fire_at >= made.next_fire_at
    assert schedules.delete("report") is True and schedules.delete("report") is False
    with pytest.raises(errors.ScheduleNotFoundError):
        schedules.pause("report")


def test_a_due_tick_fires_once_with_its_run_and_input(
    schedules: Schedules, schedule_store: PostgresScheduleStore, store: PostgresCheckpointStore
) -> None:
    made = schedules.create("tick", "reporter", "Send the report", every=1, overlap="allow")
    _wait_for_tick(schedule_store, "tick")
    first = _sweep(schedule_store, grace=GRACE)
    again = _sweep(schedule_store, grace=GRACE)
    assert first.now is not None and len(first.fired) >= 1
    # The second sweep fires no tick twice: only those that came due between the two sweeps (none,
    # unless a whole second boundary passed between them, which a loaded machine makes likely).
    assert [tick for _, tick, _ in again.fired] == _seconds_after(first.fired[-1][1], again.now or first.now)
    name, tick, session_id = first.fired[0]
    assert name == "tick" and tick == made.next_fire_at
    assert session_id == f"sched-{made.schedule_id}-{tick:%Y%m%dT%H%M%SZ}"
    (queued,) = store.inbox(session_id, 0)
    assert queued.messages[0].content == "Send the report"
    sent: list[str] = []
    assert publish(first, sent.append) == len(first.fired) and sent == first.session_ids
    fires = schedules.fires("tick")
    assert [f.session_id for f in reversed(fires)] == first.session_ids + again.session_ids
    assert schedule_store.get("tick").last_session_id == (first.session_ids + again.session_ids)[-1]


def test_a_tick_claimed_before_never_fires_again_whatever_became_of_its_run(
    schedules: Schedules, schedule_store: PostgresScheduleStore, store: PostgresCheckpointStore
) -> None:
    made = schedules.create("again", "reporter", "Send the report", every=3600, overlap="allow")
    tick = made.next_fire_at

    def due_now() -> None:  # as a redefinition or a resume may set the next tick back
        with store.engine.begin() as conn:
            conn.execute(text("UPDATE schedules SET next_fire_at = now() - interval '1 second' WHERE name = 'again'"))

    def same_tick(schedule: Schedule, now: datetime, previous_busy: bool) -> TickPlan:
        return TickPlan(fire=[tick], skip=[], next_fire_at=tick + timedelta(hours=2))

    due_now()
    first = schedule_store.fire_next_due(same_tick)
    assert first is not None and [t for t, _ in first.fired] == [tick]
    session_id = first.fired[0][1]
    # When the same tick comes up again, with its run still there and then with its run gone (pruned, deleted)
    due_now()
    kept = schedule_store.fire_next_due(same_tick)
    store.delete(session_id)
    due_now()
    gone = schedule_store.fire_next_due(same_tick)
    # Then it starts nothing, and its claim still names the run it started
    assert kept is not None and gone is not None and kept.fired == gone.fired == []
    assert store.load(session_id) is None
    assert [(f.fire_at, f.session_id, f.outcome) for f in schedules.fires("again")] == [(tick, session_id, "fired")]


def test_overlap_skip_claims_ticks_without_runs_until_the_previous_run_finishes(
    schedules: Schedules, schedule_store: PostgresScheduleStore, finish: Callable[[str], object]
) -> None:
    schedules.create("slow", "reporter", "Send the report", every=1, overlap="skip")
    _wait_for_tick(schedule_store, "slow")
    first = _sweep(schedule_store, grace=GRACE)
    assert len(first.fired) == 1
    _wait_for_tick(schedule_store, "slow")
    blocked = _sweep(schedule_store, grace=GRACE)
    assert blocked.fired == [] and blocked.skipped >= 1
    finish(first.session_ids[0])
    _wait_for_tick(schedule_store, "slow")
    after = _sweep(schedule_store, grace=GRACE)
    assert len(after.fired) == 1
    outcomes = [f.outcome for f in reversed(schedules.fires("slow"))]
    assert outcomes[0] == "fired" and outcomes[-1] == "fired" and "skipped" in outcomes
    assert len(outcomes) == len(set(f.fire_at for f in schedules.fires("slow")))


def test_overlap_allow_starts_a_run_per_tick_while_others_run(
    schedules: Schedules, schedule_store: PostgresScheduleStore
) -> None:
    schedules.create("busy", "reporter", "Send the report", every=1, overlap="allow")
    fired: list[str] = []
    for _ in range(2):
        _wait_for_tick(schedule_store, "busy")
        fired += _sweep(schedule_store, grace=GRACE).session_ids
    assert len(fired) >= 2 and len(set(fired)) == len(fired)


def _downtime(store: PostgresScheduleStore, name: str, minutes: int) -> datetime:
    """As if every beat was down for ``minutes``: the schedule's next tick is that far in the past (returned)."""
    with store.engine.begin() as conn:
        first: datetime = conn.execute(
            text(
                "UPDATE schedules SET next_fire_at = date_trunc('minute', now()) - make_interval(mins => :m)"
                " WHERE name = :name RETURNING next_fire_at"
            ),
            {"m": minutes, "name": name},
        ).scalar_one()
    return first


@pytest.mark.parametrize("catch_up", ["one", "skip"])
def test_after_downtime_the_catch_up_policy_decides(
    catch_up: str, schedules: Schedules, schedule_store: PostgresScheduleStore
) -> None:
    schedules.create("minutely", "reporter", "Send the report", cron="* * * * *", overlap="allow", catch_up=catch_up)  # type: ignore[arg-type]
    first = _downtime(schedule_store, "minutely", 10)
    result = _sweep(schedule_store, grace=timedelta(seconds=5))
    assert result.now is not None
    on_time = result.now - result.now.replace(second=0, microsecond=0) <= timedelta(seconds=5)
    current = result.now.replace(second=0, microsecond=0)
    # Counted from the sweep's own clock: a minute may have turned since the downtime was set.
    overdue = (current - first) // timedelta(minutes=1)
    assert overdue in (10, 11)
    ticks = [tick for _, tick, _ in result.fired]
    if on_time:  # the current minute's tick is within the grace: it fires as itself
        assert ticks == [current] and result.missed == overdue
    elif catch_up == "one":
        assert ticks == [current] and result.missed == overdue
    else:
        assert ticks == [] and result.missed == overdue + 1
    assert schedule_store.get("minutely").next_fire_at == current + timedelta(minutes=1)
    later = _sweep(schedule_store, grace=timedelta(seconds=5))
    # Nothing fires twice; only the next minute's tick, if the minute turned between the two sweeps.
    turned = later.now is not None and later.now >= current + timedelta(minutes=1)
    assert [tick for _, tick, _ in later.fired] == ([current + timedelta(minutes=1)] if turned else [])


def test_a_paused_schedule_does_not_fire_and_resumes_from_now(
    schedules: Schedules, schedule_store: PostgresScheduleStore
) -> None:
    schedules.create("quiet", "reporter", "Send the report", every=1, overlap="allow")
    schedules.pause("quiet")
    _downtime(schedule_store, "quiet", 1)
    assert _sweep(schedule_store, grace=GRACE).fired == []
    # The resume reads the database's clock between these two readings; its next tick is the first
    # whole second after that moment, so it is bracketed whichever second boundary falls in between.
    before = _db_now(schedule_store)
    resumed = schedules.resume("quiet")
    after = _db_now(schedule_store)
    assert before < resumed.next_fire_at <= after + timedelta(seconds=1)
    assert resumed.next_fire_at.microsecond == 0


def test_declared_schedules_sync_idempotently_and_keep_a_pause(schedule_store: PostgresScheduleStore) -> None:
    synced = sync_declared(schedule_store, ["tests.support.schedule_declared"])
    assert sorted(s.name for s in synced) == ["daily-report", "heartbeat"]
    assert all(s.origin == "code" for s in synced)
    schedule_store.pause("heartbeat")
    again = {s.name: s for s in sync_declared(schedule_store, ["tests.support.schedule_declared"])}
    assert again["heartbeat"].paused is True
    assert again["daily-report"].next_fire_at == {s.name: s for s in synced}["daily-report"].next_fire_at
    assert len(schedule_store.list()) == 2
    with pytest.raises(errors.ConfigurationError):
        sync_declared(schedule_store, ["tests.support.no_such_module"])


def test_the_cli_creates_lists_pauses_and_deletes(schedules: Schedules, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="lousho")
    schedule_cli.add_cli(parser.add_subparsers(dest="command", required=True))

    def lousho(*argv: str) -> tuple[int, str]:
        args = parser.parse_args(list(argv))
        code = args.fn(schedules._client, args)
        return code, capsys.readouterr().out

    code, out = lousho(
        "schedules",
        "create",
        "nightly",
        "reporter",
        "Send the report",
        "--cron",
        "0 2 * * *",
        "--timezone",
        "America/New_York",
        "--json",
    )
    assert code == 0 and json.loads(out)["cron"] == "0 2 * * *"
    code, out = lousho("schedules", "list")
    assert code == 0 and out.startswith("nightly  reporter  cron '0 2 * * *' America/New_York")
    assert lousho("schedules", "pause", "nightly")[1].startswith("paused nightly")
    assert lousho("schedules", "resume", "nightly")[1].startswith("resumed nightly")
    assert lousho("schedules", "fires", "nightly")[1].strip() == "no ticks fired yet"
    assert lousho("schedules", "delete", "nightly") == (0, "deleted nightly\n")
    with pytest.raises(SystemExit):
        parser.parse_args(["schedules", "create", "x", "reporter", "hi"])  # neither --cron nor --every


def test_a_declared_fairness_key_rides_with_the_runs_the_schedule_starts(
    schedule_store: PostgresScheduleStore, store: PostgresCheckpointStore
) -> None:
    with pytest.raises(errors.ConfigurationError, match="fairness key"):
        declare("fair", "reporter", "Send the report", every=1, fairness_key="no spaces")
    schedule_store.sync(declare("fair", "reporter", "Send the report", every=1, fairness_key="tenant-acme"))
    assert schedule_store.get("fair").fairness_key == "tenant-acme"
    _wait_for_tick(schedule_store, "fair")
    fired = _sweep(schedule_store, grace=GRACE).fired
    assert fired
    (entry,) = store.inbox(fired[0][2], 0)
    assert entry.fairness_key == "tenant-acme" and entry.metadata is None
