"""A broken schedule next to a healthy one under a real ``celery beat`` and ``celery worker``: the healthy one fires.

The broken row names a time zone no host knows and is written with SQL, as a hand edit or a row
checked on a host with another time zone database would be. It is the most overdue schedule, so
every sweep meets it first. Prints the healthy schedule's ticks expected / fired / duplicated /
missed, and how ``lousho schedules list`` shows the broken one.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import text

from store.schedules import PostgresScheduleStore
from store.ticks import tick_session_id
from tests.support import services
from tests.support.cluster import ROOT, Cluster

pytestmark = pytest.mark.crash

HEALTHY, BROKEN = "healthy-every-second", "broken-mars"
AGENT = "serial"
#: Ticks of the healthy schedule the test waits for (one per second from its first tick).
TICKS = 8
#: Worker and beat start-up, and a loaded 2-core machine, on top of the lag the settings allow.
SLACK_S = 20.0


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    made = Cluster(tmp_path / "cluster")
    yield made
    made.close()


def _db_now(store: PostgresScheduleStore) -> datetime:
    with store.engine.connect() as conn:
        now: datetime = conn.execute(text("SELECT now()")).scalar_one()
    return now


def _lousho(cluster: Cluster, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "producer.cli", *argv],
        cwd=ROOT,
        env=cluster.env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_broken_schedule_is_listed_broken_and_the_healthy_one_fires_every_tick_under_real_beat(
    cluster: Cluster,
) -> None:
    settings = services.test_settings()
    interval = settings.schedule_interval_s
    store = PostgresScheduleStore(cluster.client.engine)
    cluster.start_worker(concurrency=2)
    with store.engine.begin() as conn:
        conn.execute(
            text("""
            INSERT INTO schedules (name, agent, input, cron, timezone, next_fire_at)
            VALUES (:name, :agent, CAST(:input AS jsonb), '* * * * *', 'Mars/Olympus', now() - interval '1 minute')
        """),
            {"name": BROKEN, "agent": AGENT, "input": json.dumps([{"role": "user", "content": "run broken turns=1"}])},
        )
    healthy = cluster.client.schedules.create(HEALTHY, AGENT, "run healthy turns=1", every=1, overlap="allow")
    first = healthy.next_fire_at
    end = first + timedelta(seconds=TICKS - 1)
    expected = [first + timedelta(seconds=n) for n in range(TICKS)]

    # When: a real beat sends the sweep every LOUSHO_SCHEDULE_INTERVAL_S; the worker runs it.
    cluster.start_beat()
    # A tick is swept by the first sweep after it: one beat period late, or two when a sweep
    # message expires in the queue (its expiry is two periods); well inside the 60 s grace.
    deadline = time.monotonic() + (end - _db_now(store)).total_seconds() + 3 * interval + SLACK_S
    while store.get(HEALTHY).next_fire_at <= end and time.monotonic() < deadline:
        time.sleep(interval / 4)

    # Then
    with store.engine.connect() as conn:
        fires = conn.execute(
            text("""
            SELECT s.name, f.fire_at, f.session_id, f.outcome FROM schedule_fires f
            JOIN schedules s USING (schedule_id)""")
        ).all()
        inbox_heads: dict[str, int] = {
            row.session_id: row.inbox_head
            for row in conn.execute(text("SELECT session_id, inbox_head FROM runs WHERE session_id LIKE 'sched-%'"))
        }
    healthy_fires = {row.fire_at: row for row in fires if row.name == HEALTHY}
    fired = [
        tick
        for tick in expected
        if tick in healthy_fires
        and healthy_fires[tick].outcome == "fired"
        and healthy_fires[tick].session_id == tick_session_id(healthy.schedule_id, tick)
        and tick_session_id(healthy.schedule_id, tick) in inbox_heads
    ]
    duplicated = sum(head - 1 for head in inbox_heads.values() if head > 1)
    missed = [tick for tick in expected if tick not in fired]
    marked = cluster.worker_logs().count(f"schedule {BROKEN} is broken")
    print(
        f"\nreal beat + worker, sweep every {interval} s; {BROKEN} (Mars/Olympus, most overdue) next to {HEALTHY}"
        f"\n  {HEALTHY}: ticks expected {len(expected)}, fired {len(fired)}, duplicated {duplicated},"
        f" missed {len(missed)}; {BROKEN}: ticks claimed {sum(1 for r in fires if r.name == BROKEN)},"
        f" marked broken by {marked} sweep(s)"
    )
    listed = _lousho(cluster, "schedules", "list")
    listed_json = _lousho(cluster, "schedules", "list", "--json")
    broken_line = next((line for line in listed.stdout.splitlines() if line.startswith(BROKEN)), None)
    print(f"  lousho schedules list -> exit {listed.returncode}: {broken_line or listed.stderr.strip()[-200:]}")
    if missed or duplicated:
        cluster.dump_logs()
    assert not missed and duplicated == 0
    assert listed.returncode == 0 and broken_line is not None
    assert "BROKEN since" in broken_line and "timezone-unknown" in broken_line and "Mars/Olympus" in broken_line
    assert listed_json.returncode == 0
    by_name = {entry["name"]: entry for entry in json.loads(listed_json.stdout)}
    assert by_name[BROKEN]["broken_error"].startswith("timezone-unknown: ") and by_name[BROKEN]["broken_at"]
    assert by_name[HEALTHY]["broken_error"] is None and by_name[HEALTHY]["broken_at"] is None
    # Marked once, then skipped by every later sweep: it is never the row a sweep trips on again.
    assert marked == 1 and not any(row.name == BROKEN for row in fires)
    cluster.wait_finished(
        [tick_session_id(healthy.schedule_id, tick) for tick in fired], timeout=settings.lease_ttl_ms / 1000 + SLACK_S
    )
