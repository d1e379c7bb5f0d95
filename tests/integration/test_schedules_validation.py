"""Schedule timing is checked where schedules are made (client, CLI, code) and computed or refused in tick arithmetic.

``every`` is 1 s to 10 years, the cron expression parses, the time zone is known: anything else is
a ``ConfigurationError`` (``LOUSHO_CONFIG_INVALID``) naming the field, before anything is stored.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import text

from producer.cli import schedules as schedule_cli
from producer.schedules import Schedules
from store import errors, records
from store.errors import ScheduleBrokenError
from store.schedule_records import build_spec
from store.schedules import PostgresScheduleStore
from store.ticks import MAX_EVERY_S
from worker.schedules import declare

MSG = [records.Message(role="user", content="Send the report")]
TEN_YEARS_S = 10 * 365 * 86_400

BAD_EVERY = [
    0,
    -5,
    1.5,
    TEN_YEARS_S + 1,
    2**31,
    10**30,
    float("inf"),
    float("nan"),
    timedelta(days=4000),
    timedelta(milliseconds=500),
]
BAD_CRON = ["0 0 30 2 *", "61 * * * *", "* * * *", "0 0 * * 1#6", "every day"]
BAD_ZONE = ["Mars/Olympus", "America", "", "../etc/passwd", "/etc/localtime", "utc"]


def _refused(make: Callable[[], object], field: str) -> errors.ConfigurationError:
    with pytest.raises(errors.ConfigurationError) as caught:
        make()
    assert caught.value.code == "LOUSHO_CONFIG_INVALID" and field in caught.value.message
    assert getattr(caught.value, "field", None) == field
    return caught.value


def test_the_longest_every_is_ten_years() -> None:
    assert MAX_EVERY_S == TEN_YEARS_S < 2**31 - 1
    assert build_spec("s", "reporter", MSG, every=MAX_EVERY_S).every_s == MAX_EVERY_S
    assert build_spec("s", "reporter", MSG, every=timedelta(days=3650)).every_s == MAX_EVERY_S


@pytest.mark.parametrize("every", BAD_EVERY, ids=repr)
def test_every_outside_one_second_to_ten_years_is_refused_naming_the_field(every: float | timedelta) -> None:
    _refused(lambda: build_spec("s", "reporter", MSG, every=every), "every")
    _refused(lambda: declare("s", "reporter", "Send the report", every=every), "every")


@pytest.mark.parametrize("cron", BAD_CRON)
def test_a_cron_expression_that_does_not_parse_is_refused_naming_the_field(cron: str) -> None:
    _refused(lambda: build_spec("s", "reporter", MSG, cron=cron), "cron")
    _refused(lambda: declare("s", "reporter", "Send the report", cron=cron), "cron")


@pytest.mark.parametrize("zone", BAD_ZONE)
def test_a_time_zone_this_host_does_not_know_is_refused_naming_the_field(zone: str) -> None:
    message = _refused(lambda: build_spec("s", "reporter", MSG, cron="0 9 * * *", timezone=zone), "timezone")
    assert repr(zone) in message.message
    _refused(lambda: declare("s", "reporter", "Send the report", every=60, timezone=zone), "timezone")


def test_ticks_past_year_9999_break_the_schedule_instead_of_overflowing() -> None:
    yearly = build_spec("s", "reporter", MSG, cron="@yearly")
    decade = build_spec("s", "reporter", MSG, every=MAX_EVERY_S)

    for spec in (yearly, decade):
        with pytest.raises(ScheduleBrokenError) as caught:
            spec.next_tick(datetime(9999, 6, 1, tzinfo=UTC))
        assert caught.value.reason == "tick-out-of-range" and str(caught.value).startswith("tick-out-of-range: ")
        assert caught.value.code == "LOUSHO_SCHEDULE_BROKEN"


@pytest.mark.integration
@pytest.mark.parametrize(
    ("timing", "field"),
    [
        ({"every": 2**31}, "every"),
        ({"every": 0}, "every"),
        ({"cron": "0 0 31 4 *"}, "cron"),
        ({"cron": "0 9 * * *", "timezone": "Mars/Olympus"}, "timezone"),
        ({"cron": "0 9 * * *", "timezone": "America"}, "timezone"),
    ],
)
def test_the_client_refuses_invalid_timing_and_stores_nothing(
    timing: dict[str, object], field: str, schedules: Schedules, schedule_store: PostgresScheduleStore
) -> None:
    _refused(lambda: schedules.create("bad", "reporter", "Send the report", **timing), field)  # type: ignore[arg-type]

    with schedule_store.engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM schedules")).scalar_one() == 0


@pytest.mark.integration
@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--every", str(2**31)], "every"),
        (["--every", "-1"], "every"),
        (["--cron", "0 0 30 2 *"], "cron"),
        (["--cron", "0 9 * * *", "--timezone", "Mars/Olympus"], "timezone"),
    ],
)
def test_the_cli_refuses_invalid_timing(argv: list[str], field: str, schedules: Schedules) -> None:
    parser = argparse.ArgumentParser(prog="lousho")
    schedule_cli.add_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["schedules", "create", "bad", "reporter", "Send the report", *argv])

    _refused(lambda: args.fn(schedules._client, args), field)

    assert schedules.list() == []
