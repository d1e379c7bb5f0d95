"""Broken schedules on the real database: marked once with their error, skipped, listed, and cleared by a fix.

Broken rows are written with SQL (a hand edit, or a row checked on a host with another time zone
database or cron library): validation at creation would refuse them.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from datetime import datetime, timedelta

import pytest
from sqlalchemy import text

from producer.cli import schedules as schedule_cli
from producer.schedules import Schedules
from store import records
from store.checkpoints import PostgresCheckpointStore
from store.schedule_records import build_spec
from store.schedules import PostgresScheduleStore
from worker.schedules import SweepResult, sweep

pytestmark = pytest.mark.integration

GRACE = timedelta(seconds=60)
#: (name, cron, every_s, timezone) of rows whose ticks cannot be computed, and the reason each gets.
BROKEN_ROWS = {
    "mars": (("* * * * *", None, "Mars/Olympus"), "timezone-unknown"),
    "feb-30": (("0 0 30 2 *", None, "UTC"), "cron-invalid"),
    "zero": ((None, 0, "UTC"), "every-invalid"),
}


def _db_now(store: PostgresScheduleStore) -> datetime:
    with store.engine.connect() as conn:
        now: datetime = conn.execute(text("SELECT now()")).scalar_one()
    return now


def _insert_raw(
    store: PostgresScheduleStore,
    name: str,
    cron: str | None,
    every_s: int | None,
    timezone: str,
    overdue_s: int = 120,
    origin: str = "api",
) -> None:
    """A schedule row written with SQL, bypassing validation, due ``overdue_s`` ago (more than any healthy one)."""
    with store.engine.begin() as conn:
        conn.execute(
            text("""
            INSERT INTO schedules (name, agent, input, cron, every_s, timezone, origin, next_fire_at)
            VALUES (:name, 'reporter', CAST(:input AS jsonb), :cron, :every_s, :timezone, :origin,
                    now() - make_interval(secs => :overdue))
        """),
            {
                "name": name,
                "input": json.dumps([{"role": "user", "content": "Send the report"}]),
                "cron": cron,
                "every_s": every_s,
                "timezone": timezone,
                "origin": origin,
                "overdue": overdue_s,
            },
        )


def _due_now(store: PostgresScheduleStore, name: str, seconds: int) -> None:
    """Make the schedule's next tick the whole second ``seconds`` before now (inside the grace)."""
    with store.engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE schedules SET next_fire_at = date_trunc('second', now())"
                " - make_interval(secs => :s) WHERE name = :name"
            ),
            {"s": seconds, "name": name},
        )


def _every_second_between(first: datetime, now: datetime) -> list[datetime]:
    ticks, tick = [], first
    while tick <= now:
        ticks.append(tick)
        tick += timedelta(seconds=1)
    return ticks


def _fires(store: PostgresScheduleStore) -> dict[str, list[tuple[datetime, str]]]:
    with store.engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT s.name, f.fire_at, f.outcome FROM schedule_fires f"
                " JOIN schedules s USING (schedule_id) ORDER BY f.fire_at"
            )
        ).all()
    found: dict[str, list[tuple[datetime, str]]] = {}
    for row in rows:
        found.setdefault(row.name, []).append((row.fire_at, row.outcome))
    return found


def test_a_schedule_whose_ticks_cannot_be_computed_is_marked_broken_and_the_others_fire_each_tick_once(
    schedules: Schedules, schedule_store: PostgresScheduleStore
) -> None:
    for name, ((cron, every_s, timezone), _) in BROKEN_ROWS.items():
        _insert_raw(schedule_store, name, cron, every_s, timezone)
    schedules.create("healthy", "reporter", "Send the report", every=1, overlap="allow")
    _due_now(schedule_store, "healthy", 3)
    first_tick = schedule_store.get("healthy").next_fire_at
    before = _db_now(schedule_store)

    first = sweep(schedule_store, grace=GRACE)
    second = sweep(schedule_store, grace=GRACE)

    after = _db_now(schedule_store)
    assert first.now is not None and first.now <= after
    print(
        f"\nfirst sweep: broken {first.broken}, fired {len(first.fired)};"
        f" second sweep: broken {second.broken}, fired {len(second.fired)}"
    )
    assert sorted(first.broken) == sorted(BROKEN_ROWS) and second.broken == []
    for name, (_, reason) in BROKEN_ROWS.items():
        stored = schedule_store.get(name)
        print(f"  {name}: {stored.broken_error}")
        assert stored.broken_error is not None and stored.broken_error.startswith(f"{reason}: ")
        assert stored.broken_at is not None and before <= stored.broken_at <= after
    # Every tick of the healthy schedule from its first to the sweeps' time fired once, whatever the
    # second the sweeps ran in; no broken schedule claimed anything.
    fires = _fires(schedule_store)
    last_sweep = max(first.now, second.now or first.now)
    assert set(fires) == {"healthy"}
    assert fires["healthy"] == [(tick, "fired") for tick in _every_second_between(first_tick, last_sweep)]
    assert [tick for _, tick, _ in first.fired + second.fired] == [tick for tick, _ in fires["healthy"]]


def test_a_broken_schedule_is_skipped_by_later_sweeps_and_keeps_its_first_error(
    schedules: Schedules, schedule_store: PostgresScheduleStore
) -> None:
    _insert_raw(schedule_store, "mars", "* * * * *", None, "Mars/Olympus")
    marked = sweep(schedule_store, grace=GRACE)
    broken = schedule_store.get("mars")

    later = [sweep(schedule_store, grace=GRACE) for _ in range(3)]

    assert marked.broken == ["mars"] and all(result.broken == [] and result.schedules == 0 for result in later)
    assert schedule_store.get("mars") == broken


def test_listing_shows_a_broken_schedule_in_text_and_json(
    schedules: Schedules, schedule_store: PostgresScheduleStore, capsys: pytest.CaptureFixture[str]
) -> None:
    _insert_raw(schedule_store, "mars", "* * * * *", None, "Mars/Olympus")
    schedules.create("nightly", "reporter", "Send the report", cron="0 2 * * *")
    sweep(schedule_store, grace=GRACE)
    parser = argparse.ArgumentParser(prog="lousho")
    schedule_cli.add_cli(parser.add_subparsers(dest="command", required=True))

    def lousho(*argv: str) -> str:
        args = parser.parse_args(list(argv))
        assert args.fn(schedules._client, args) == 0
        return capsys.readouterr().out

    listed = {s.name: s for s in schedules.list()}
    text_out = lousho("schedules", "list")
    json_out = {entry["name"]: entry for entry in json.loads(lousho("schedules", "list", "--json"))}

    print(f"\n{text_out}")
    assert listed["mars"].broken_error is not None and listed["nightly"].broken_error is None
    mars_line = next(line for line in text_out.splitlines() if line.startswith("mars  "))
    assert "BROKEN since" in mars_line and "timezone-unknown: time zone 'Mars/Olympus'" in mars_line
    assert "1 broken (not firing): mars" in text_out
    assert "BROKEN" not in next(line for line in text_out.splitlines() if line.startswith("nightly  "))
    assert json_out["mars"]["broken_error"] == listed["mars"].broken_error
    assert listed["mars"].broken_at is not None
    assert datetime.fromisoformat(json_out["mars"]["broken_at"]) == listed["mars"].broken_at
    assert json_out["nightly"]["broken_error"] is None and json_out["nightly"]["broken_at"] is None


def test_redefining_a_broken_schedule_in_code_clears_it_and_it_fires(schedule_store: PostgresScheduleStore) -> None:
    _insert_raw(schedule_store, "report", "0 9 * * *", None, "Mars/Olympus", origin="code")
    sweep(schedule_store, grace=GRACE)
    assert schedule_store.get("report").broken_error is not None
    fixed = build_spec(
        "report",
        "reporter",
        [records.Message(role="user", content="Send the report")],
        cron="0 9 * * *",
        timezone="Europe/Paris",
    )

    before = _db_now(schedule_store)
    synced = schedule_store.sync(fixed)
    after = _db_now(schedule_store)

    assert synced.broken_error is None and synced.broken_at is None and synced.timezone == "Europe/Paris"
    assert before < synced.next_fire_at <= after + timedelta(days=1)
    assert sweep(schedule_store, grace=GRACE).broken == []


def test_redefining_in_code_with_the_same_spec_clears_a_broken_schedule(schedule_store: PostgresScheduleStore) -> None:
    spec = build_spec("hourly", "reporter", [records.Message(role="user", content="Send the report")], cron="0 * * * *")
    schedule_store.sync(spec)
    with schedule_store.engine.begin() as conn:  # as a host without this zone or cron would have marked it
        conn.execute(
            text(
                "UPDATE schedules SET broken_error = 'cron-invalid: elsewhere', broken_at = now(),"
                " next_fire_at = now() - interval '1 day' WHERE name = 'hourly'"
            )
        )

    before = _db_now(schedule_store)
    synced = schedule_store.sync(spec)
    after = _db_now(schedule_store)

    assert synced.broken_error is None and before < synced.next_fire_at <= after + timedelta(hours=1)


def test_resume_clears_a_fixed_schedule_and_a_still_broken_one_breaks_again(
    schedules: Schedules, schedule_store: PostgresScheduleStore
) -> None:
    _insert_raw(schedule_store, "mars", "* * * * *", None, "Mars/Olympus")
    sweep(schedule_store, grace=GRACE)
    first = schedule_store.get("mars")

    still = schedules.resume("mars")

    assert still.broken_error == first.broken_error and still.paused is False
    assert first.broken_at is not None and still.broken_at is not None and still.broken_at > first.broken_at
    assert sweep(schedule_store, grace=GRACE).schedules == 0
    # The zone becomes known (here: the row is corrected) and a resume clears it.
    with schedule_store.engine.begin() as conn:
        conn.execute(text("UPDATE schedules SET timezone = 'Europe/Paris' WHERE name = 'mars'"))

    before = _db_now(schedule_store)
    fixed = schedules.resume("mars")
    after = _db_now(schedule_store)

    assert fixed.broken_error is None and fixed.broken_at is None
    assert before < fixed.next_fire_at <= after + timedelta(minutes=1)


def test_a_paused_broken_schedule_resumed_while_still_broken_stays_broken_and_unpaused(
    schedules: Schedules, schedule_store: PostgresScheduleStore
) -> None:
    _insert_raw(schedule_store, "zero", None, 0, "UTC")
    sweep(schedule_store, grace=GRACE)
    schedules.pause("zero")

    resumed = schedules.resume("zero")

    assert resumed.paused is False and resumed.broken_error is not None
    assert resumed.broken_error.startswith("every-invalid: ")


def test_deleting_and_creating_a_broken_schedule_again_with_valid_timing_makes_it_fire(
    schedules: Schedules, schedule_store: PostgresScheduleStore
) -> None:
    _insert_raw(schedule_store, "mars", "* * * * *", None, "Mars/Olympus")
    sweep(schedule_store, grace=GRACE)

    schedules.delete("mars")
    again = schedules.create("mars", "reporter", "Send the report", every=1, overlap="allow")
    _due_now(schedule_store, "mars", 1)
    result = sweep(schedule_store, grace=GRACE)

    assert again.broken_error is None and result.broken == [] and len(result.fired) >= 2


@pytest.mark.parametrize(
    "stored",
    [
        pytest.param(("0 0 30 2 *", None, "UTC"), id="cron-rejected"),
        pytest.param(("* * * * *", None, "America"), id="zone-is-a-directory"),
        pytest.param((None, -5, "UTC"), id="negative-every"),
    ],
)
def test_a_broken_row_does_not_roll_back_the_claims_of_the_schedules_swept_before_it(
    stored: tuple[str | None, int | None, str],
    schedules: Schedules,
    schedule_store: PostgresScheduleStore,
    store: PostgresCheckpointStore,
    finish: Callable[[str], list[object]],
) -> None:
    schedules.create("early", "reporter", "Send the report", every=1, overlap="allow")
    _due_now(schedule_store, "early", 10)  # more overdue than the broken row: swept before it
    _insert_raw(schedule_store, "bad", *stored, overdue_s=5)
    schedules.create("late", "reporter", "Send the report", every=1, overlap="allow")
    _due_now(schedule_store, "late", 2)
    firsts = {name: schedule_store.get(name).next_fire_at for name in ("early", "late")}

    # Three locks: early, bad, late. Without the bound, a sweep that crosses a second boundary would find
    # "early" (every second) due again after "late" and sweep it a second time.
    result = sweep(schedule_store, grace=GRACE, max_schedules=3)

    assert result.broken == ["bad"] and schedule_store.get("bad").broken_error is not None
    ticks = {name: [tick for fired_by, tick, _ in result.fired if fired_by == name] for name in firsts}
    assert [name for name, _, _ in result.fired] == ["early"] * len(ticks["early"]) + ["late"] * len(ticks["late"])
    for name, first in firsts.items():  # every tick from the first one, in order, none left out
        assert ticks[name] == [first + timedelta(seconds=n) for n in range(len(ticks[name]))]
    assert len(ticks["early"]) >= 11 and len(ticks["late"]) >= 3
    # The runs of the ticks claimed before the broken row are committed, with their input, and run.
    for _, _, session_id in result.fired:
        assert store.inbox(session_id, 0)
    outcomes = finish(next(sid for name, _, sid in result.fired if name == "early"))
    assert outcomes and set(_fires(schedule_store)) == {"early", "late"}


def test_a_sweep_result_lists_nothing_broken_when_every_schedule_is_healthy(
    schedules: Schedules, schedule_store: PostgresScheduleStore
) -> None:
    schedules.create("healthy", "reporter", "Send the report", every=1, overlap="allow")
    _due_now(schedule_store, "healthy", 1)

    result: SweepResult = sweep(schedule_store, grace=GRACE)

    assert result.broken == [] and len(result.fired) >= 2
