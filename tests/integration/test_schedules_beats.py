"""Two beats sweeping at once, one SIGKILLed and restarted midway: every tick fires exactly once, none is missed.

Each beat is a separate process (``tests.support.schedule_beat``) calling ``worker.schedules.sweep`` every
second; three schedules tick every second. Prints ticks expected / fired / duplicated / missed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from datetime import datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import text

from producer.schedules import Schedules
from store.checkpoints import PostgresCheckpointStore
from store.schedules import PostgresScheduleStore
from store.ticks import tick_session_id
from tests.support import services

pytestmark = pytest.mark.integration

SCHEDULES = ("beat-a", "beat-b", "beat-c")
RUN_S = 12.0


def _start(name: str, offset: float, duration: float) -> subprocess.Popen[str]:
    env = {**os.environ, **services.test_environment()}
    time.sleep(offset)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.schedule_beat",
            "--name",
            name,
            "--interval",
            "1",
            "--duration",
            str(duration),
        ],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _first_sweep(process: subprocess.Popen[str]) -> list[str]:
    """The beat's output up to its first sweep report (so a kill lands while it takes part)."""
    assert process.stdout is not None
    lines: list[str] = []
    while not lines or '"started"' not in lines[-1]:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
    return lines


def _reports(process: subprocess.Popen[str], read: list[str] | None = None) -> list[dict[str, Any]]:
    out, _ = process.communicate(timeout=30)
    lines = [*(read or []), *out.splitlines()]
    return [json.loads(line) for line in lines if line.startswith("{")]


def test_two_beats_and_a_killed_one_fire_every_tick_exactly_once(
    schedules: Schedules, schedule_store: PostgresScheduleStore
) -> None:
    made = [schedules.create(name, "reporter", f"tick of {name}", every=1, overlap="allow") for name in SCHEDULES]
    started = time.monotonic()
    steady = _start("steady", 0.0, RUN_S)
    victim = _start("victim", 0.5, RUN_S)
    victim_output = _first_sweep(victim)
    time.sleep(2.5)
    victim.send_signal(signal.SIGKILL)  # no cleanup: a transaction in flight is rolled back by Postgres
    killed_at = time.monotonic() - started
    victim_reports = _reports(victim, victim_output)
    time.sleep(2.0)
    restarted = _start("restarted", 0.0, RUN_S - (time.monotonic() - started))
    restarted_at = time.monotonic() - started
    reports = _reports(steady) + victim_reports + _reports(restarted)
    with schedule_store.engine.connect() as conn:
        fires = conn.execute(text("SELECT schedule_id, fire_at, session_id, outcome FROM schedule_fires")).all()
        runs: dict[str, int] = {
            row.session_id: row.inbox_head
            for row in conn.execute(text("SELECT session_id, inbox_head FROM runs WHERE session_id LIKE 'sched-%'"))
        }

    # Expected: every tick from each schedule's first one to the start of the last sweep of any beat
    # (each of those ticks was due when that sweep began); later ticks are past the window's edge.
    end = max(datetime.fromisoformat(str(report["started"])) for report in reports if "started" in report)
    expected: set[tuple[int, datetime]] = set()
    for schedule in made:
        tick = schedule.next_fire_at
        while tick <= end:
            expected.add((schedule.schedule_id, tick))
            tick += timedelta(seconds=1)
    claimed = Counter((row.schedule_id, row.fire_at) for row in fires)
    reported = Counter(sid for report in reports for sid in report.get("fired", []))
    fired = {key for key in claimed if key in expected}
    duplicated = (
        sum(n - 1 for n in claimed.values() if n > 1)
        + sum(n - 1 for n in reported.values() if n > 1)
        + len([head for head in runs.values() if head != 1])
    )
    missed = expected - fired
    by_beat = Counter(str(report["beat"]) for report in reports for _ in report.get("fired", []))
    swept_by = Counter(str(report["beat"]) for report in reports if "started" in report)
    print(
        f"\nbeats: steady + victim (SIGKILL at {killed_at:.1f} s, restarted at {restarted_at:.1f} s),"
        f" {len(SCHEDULES)} schedules every 1 s, window {len(expected) // len(SCHEDULES)} s"
    )
    print(
        f"  ticks expected {len(expected)}, fired {len(fired)}, duplicated {duplicated}, missed {len(missed)};"
        f" runs fired per beat {dict(by_beat)}, sweeps per beat {dict(swept_by)},"
        f" publishes lost with the killed beat {len({r.session_id for r in fires} - set(reported))}"
        " (left to the recover sweep)"
    )
    assert len(expected) >= len(SCHEDULES) * 8
    assert duplicated == 0 and not missed
    assert all(row.outcome == "fired" for row in fires)
    for row in fires:
        assert row.session_id == tick_session_id(row.schedule_id, row.fire_at) and runs[row.session_id] == 1
    # A beat killed between a schedule's commit and its report lost that publish (crash point cp14):
    # the run is in progress with its input, so the recover sweep re-enqueues it.
    unreported = {row.session_id for row in fires} - set(reported)
    assert set(reported) <= {row.session_id for row in fires}
    stale = {session_id for session_id, _ in PostgresCheckpointStore(schedule_store.engine).stale_runs(0, limit=10_000)}
    assert unreported <= stale
    assert swept_by["steady"] > 0 and swept_by["victim"] > 0 and swept_by["restarted"] > 0
