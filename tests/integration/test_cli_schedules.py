"""``lousho schedules create|list|pause|resume|delete|fires`` on the real services (no beat fires here)."""

from __future__ import annotations

import pytest

from tests.support.cli_fixtures import Lousho

pytestmark = pytest.mark.integration


def test_create_prints_the_schedule(lousho: Lousho) -> None:
    printed = lousho("schedules", "create", "hourly", "weather", "Weather report", "--every", "3600")
    as_json = lousho(
        "schedules",
        "create",
        "daily",
        "weather",
        "Weather report",
        "--cron",
        "0 9 * * *",
        "--timezone",
        "Europe/Oslo",
        "--overlap",
        "allow",
        "--catch-up",
        "skip",
        "--json",
    )

    assert printed.code == 0
    assert printed.out.startswith("created hourly  weather  every 3600s  overlap=skip  catch_up=one  next ")
    made = as_json.json()
    assert as_json.code == 0
    assert made["name"] == "daily" and made["agent"] == "weather" and made["cron"] == "0 9 * * *"
    assert made["timezone"] == "Europe/Oslo" and made["overlap"] == "allow" and made["catch_up"] == "skip"
    assert made["broken_error"] is None and made["broken_at"] is None and "next_fire_at" in made


def test_list_shows_every_schedule(lousho: Lousho) -> None:
    assert lousho("schedules", "list").out == "no schedules\n"
    assert lousho("schedules", "list", "--json").json() == []
    assert lousho("schedules", "create", "hourly", "weather", "hi", "--every", "3600").code == 0

    printed = lousho("schedules", "list")
    as_json = lousho("schedules", "list", "--json")

    assert printed.out.startswith("hourly  weather  every 3600s")
    assert [s["name"] for s in as_json.json()] == ["hourly"]


def test_pause_and_resume_print_the_schedule(lousho: Lousho) -> None:
    assert lousho("schedules", "create", "hourly", "weather", "hi", "--every", "3600").code == 0

    paused = lousho("schedules", "pause", "hourly")
    paused_json = lousho("schedules", "pause", "hourly", "--json")
    resumed = lousho("schedules", "resume", "hourly", "--json")

    assert paused.code == 0 and paused.out.startswith("paused hourly") and "  paused" in paused.out
    assert paused_json.json()["paused"] is True
    assert resumed.code == 0 and resumed.json()["paused"] is False


def test_fires_of_a_schedule_that_never_fired(lousho: Lousho) -> None:
    assert lousho("schedules", "create", "hourly", "weather", "hi", "--every", "3600").code == 0

    assert lousho("schedules", "fires", "hourly").out == "no ticks fired yet\n"
    assert lousho("schedules", "fires", "hourly", "--limit", "5", "--json").json() == []


def test_delete_says_whether_there_was_a_schedule(lousho: Lousho) -> None:
    assert lousho("schedules", "create", "hourly", "weather", "hi", "--every", "3600").code == 0

    deleted = lousho("schedules", "delete", "hourly")
    again = lousho("schedules", "delete", "hourly", "--json")

    assert (deleted.code, deleted.out) == (0, "deleted hourly\n")
    assert again.code == 1 and again.json() == {"name": "hourly", "deleted": False}


def test_an_unknown_schedule_prints_its_code(lousho: Lousho) -> None:
    printed = lousho("schedules", "pause", "nothing")
    as_json = lousho("schedules", "resume", "nothing", "--json")

    assert printed.code == 1 and printed.error_code() == "LOUSHO_SCHEDULE_NOT_FOUND"
    assert as_json.code == 1 and as_json.json()["error"]["code"] == "LOUSHO_SCHEDULE_NOT_FOUND"


@pytest.mark.parametrize(
    "argv",
    [
        ["--cron", "not a cron"],
        ["--cron", "0 9 * * *", "--timezone", "Mars/Olympus"],
        ["--every", "0"],
    ],
)
def test_an_invalid_timing_prints_the_configuration_code(lousho: Lousho, argv: list[str]) -> None:
    printed = lousho("schedules", "create", "broken", "weather", "hi", *argv, "--json")

    assert printed.code == 1
    assert printed.json()["error"]["code"] == "LOUSHO_CONFIG_INVALID"
    assert lousho("schedules", "list", "--json").json() == []


def test_a_taken_name_prints_the_configuration_code(lousho: Lousho) -> None:
    assert lousho("schedules", "create", "hourly", "weather", "hi", "--every", "3600").code == 0

    printed = lousho("schedules", "create", "hourly", "weather", "hi", "--every", "60")

    assert printed.code == 1 and printed.error_code() == "LOUSHO_CONFIG_INVALID"
