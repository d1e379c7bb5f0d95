"""``worker.starts``: beat entries on a shared grid, the tick a message was sent for, and the run a message starts."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from celery.schedules import crontab

from store import errors
from worker.starts import START_TASK, Every, beat_entry, run_id_for, tick_of


def test_a_message_sent_just_after_a_grid_point_belongs_to_that_tick() -> None:
    assert tick_of(1000.02, 5.0) == datetime.fromtimestamp(1000, UTC)
    assert tick_of(1000.9, 5.0) == datetime.fromtimestamp(1000, UTC)
    assert tick_of(1002.6, 5.0) == datetime.fromtimestamp(1000, UTC)  # a late beat: still the tick it fired for
    assert tick_of(1004.4, 5.0) == datetime.fromtimestamp(1000, UTC)
    assert tick_of(1004.9999, 5.0) == datetime.fromtimestamp(1005, UTC)  # a stamp a hair before the point
    assert tick_of(125.3, None) == datetime.fromtimestamp(120, UTC)  # cron: the minute


def test_every_is_due_at_each_grid_point_whatever_the_beat_started_at(monkeypatch: pytest.MonkeyPatch) -> None:
    every = Every(5.0)
    clock = {"now": 1003.0}
    monkeypatch.setattr(every, "now", lambda: datetime.fromtimestamp(clock["now"], UTC))
    due, wait = every.is_due(datetime.fromtimestamp(1001.2, UTC))
    assert (due, round(wait, 3)) == (False, 2.0)
    clock["now"] = 1005.01
    due, wait = every.is_due(datetime.fromtimestamp(1001.2, UTC))
    assert due and round(wait, 2) == 4.99


def test_beat_entry_names_the_task_queue_and_tick_and_refuses_bad_names() -> None:
    entry = beat_entry("nightly", "shop", "Send the report", 60, queue="lousho")
    assert entry["task"] == START_TASK and entry["options"]["queue"] == "lousho-start"
    assert entry["kwargs"]["beat_entry"] == "nightly" and entry["kwargs"]["every_s"] == 60.0
    cron = beat_entry("daily", "shop", "x", crontab(minute=0, hour=9))
    assert cron["kwargs"]["every_s"] is None and isinstance(cron["schedule"], crontab)
    with pytest.raises(errors.ConfigurationError):
        beat_entry("no spaces", "shop", "x", 60)
    with pytest.raises(errors.ConfigurationError):
        beat_entry("ok", "shop", "x", "hourly")


def test_the_run_a_message_starts() -> None:
    assert run_id_for("abc", None, None, None, None) == ("task-abc", "celery-abc")
    assert run_id_for("abc", "order-7", None, None, None) == ("order-7", "celery-abc")
    assert run_id_for("abc", None, "ticks", 5.0, 1000.4) == ("ticks-19700101T001640", "tick-19700101T001640")
    with pytest.raises(errors.SessionIdInvalidError):
        run_id_for("abc", "lead.task-0123456789abcdef", None, None, None)
