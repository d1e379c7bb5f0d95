"""Soak of production weather (issue 10): a flaky provider and failed follow-ups through real workers.

Run by hand from the repository root, with PostgreSQL and Redis up on 127.0.0.1 (not part of the
test suite; about 3 minutes with the defaults, never more than ``--max-seconds``):

    .venv/bin/python -m bench.soak     # --runs 200 --fail-rate 0.2 --follow-up-fail-rate 0.05 --seed 1

What it does:

1. recreates its own database (``--database``, default ``lousho_soak``) and flushes its own Redis db
   (``--redis-db``, default 9) on the servers of ``LOUSHO_DATABASE_URL`` and ``LOUSHO_REDIS_URL``
   (loopback only), with the CI timing of the tests (lease TTL 2 s, sweep every 1 s) and every other
   setting at its default;
2. starts the fake OpenAI-compatible provider on 127.0.0.1, ``--workers`` real ``celery worker``
   processes (``-c --concurrency``, agents from ``tests.support.weather_agents``) and one beat;
3. sends ``--runs`` runs of the ``weather`` agent over ``--arrival-s`` seconds (``--turns`` model turns
   each). The provider fails about ``--fail-rate`` of the model calls transiently (500, 502, 503, 429
   or a hang-up), decided by a hash of (seed, run, turn, attempt), so a rerun with the same seed
   meets the same failures. ``--follow-up-fail-rate`` of the runs get, once finished, a follow-up the
   provider refuses for good (400 context length): those runs must end parked and listed;
4. once every retryable run finished and every failed one is parked, watches the sweep for
   ``--settle-s`` more seconds, so the re-send rate is seen with every failed run accumulated;
5. prints the figures and exits 0 when: no retryable run is left unfinished, ``pending()`` lists every
   failed run as parked, the sweep re-sent none of the parked runs (its rate stays flat as they
   accumulate), and the I19 checker (sent by beat every 2 s) found no unexplained run at any look.

Re-sends are counted twice, independently: from the publishes the workers log in
``LOUSHO_WEATHER_LOG`` with the task that made them (``lousho.recover`` is the sweep), per run, and
from the workers' own ``recover: re-enqueued N run(s)`` log lines.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}
#: How often the soak's beat sends the I19 checker (``lousho.doctor``): its gauge must read 0 at every look.
DOCTOR_INTERVAL_S = 2.0
_RECOVER_LINE = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+): \w+/[^\]]+\] recover: re-enqueued (\d+) run")


@dataclass(frozen=True)
class Config:
    """One soak: load, failure rates, timing bounds and where it runs."""

    runs: int = 200
    workers: int = 2
    concurrency: int = 2
    fail_rate: float = 0.2
    follow_up_fail_rate: float = 0.05
    arrival_s: float = 60.0
    turns: int = 3
    tool_ms: int = 50
    settle_s: float = 45.0
    window_s: float = 15.0
    max_seconds: float = 420.0
    seed: int = 1
    database: str = "lousho_soak"
    redis_db: int = 9
    keep: bool = False


@dataclass
class Progress:
    """What the soak saw happen, as it happened (monotonic seconds since the first send)."""

    sent: dict[str, float] = field(default_factory=dict)
    followed_up: dict[str, float] = field(default_factory=dict)
    parked: dict[str, float] = field(default_factory=dict)
    finished: dict[str, float] = field(default_factory=dict)
    drained_at: float | None = None
    #: The I19 checker's looks seen (their times), and the most runs one of them found unexplained.
    doctor_looks: set[datetime] = field(default_factory=set)
    unexplained_max: int = 0

    def note_doctor(self, database_url: str) -> None:
        """Read the checker's latest look (``lousho_runs_unexplained`` is its count)."""
        import psycopg

        with psycopg.connect(database_url) as conn:
            look = conn.execute("SELECT looked_at, unexplained FROM doctor_looks WHERE name = 'i19'").fetchone()
        if look is not None and look[0] not in self.doctor_looks:
            self.doctor_looks.add(look[0])
            self.unexplained_max = max(self.unexplained_max, int(look[1]))


def parse_args(argv: list[str] | None = None) -> Config:
    """The command line as a ``Config``: one ``--flag`` per field, with the field's default."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak", description=__doc__.splitlines()[0] if __doc__ else None
    )
    defaults = Config()
    for name, value in vars(defaults).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            parser.add_argument(flag, action="store_true", default=value)
        else:
            parser.add_argument(flag, type=type(value), default=value)
    return Config(**vars(parser.parse_args(argv)))


def _check_loopback() -> None:
    for variable, default in (
        ("LOUSHO_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test"),
        ("LOUSHO_REDIS_URL", "redis://127.0.0.1:6379/0"),
    ):
        host = urlparse(os.environ.get(variable, default)).hostname
        if host not in _LOOPBACK:
            raise SystemExit(f"{variable} points at {host!r}: the soak only talks to 127.0.0.1")


def _rows(database_url: str, session_ids: list[str]) -> dict[str, dict[str, Any]]:
    import psycopg

    with psycopg.connect(database_url) as conn:
        found = conn.execute(
            "SELECT session_id, status, last_error, inbox_head, inbox_cursor FROM runs WHERE session_id = ANY(%s)",
            (session_ids,),
        ).fetchall()
    return {r[0]: {"status": r[1], "last_error": r[2], "inbox_head": r[3], "inbox_cursor": r[4]} for r in found}


def _settled(row: dict[str, Any] | None) -> bool:
    return (
        row is not None
        and row["status"] == "finished"
        and row["last_error"] is None
        and row["inbox_cursor"] >= row["inbox_head"]
    )


def _parked(row: dict[str, Any] | None) -> bool:
    error = (row or {}).get("last_error")
    return isinstance(error, dict) and bool(error) and not error.get("retryable", False)


def soak(config: Config) -> int:
    """Run one soak; returns the exit code (0 when every criterion holds)."""
    _check_loopback()
    # The test support reads its database and Redis db names at import: set them first.
    os.environ["LOUSHO_TEST_DATABASE"] = config.database
    os.environ["LOUSHO_TEST_REDIS_DB"] = str(config.redis_db)
    from tests.fakes.provider_server import FakeProviderServer
    from tests.support import services
    from tests.support.cluster import Cluster
    from tests.support.weather_agents import AGENT, LOG_ENV, RECOVER, URL_ENV, WeatherScript, ask, flaky

    problem = services.services_available()
    if problem is not None:
        raise SystemExit(problem)
    services.recreate_database()
    services.reset_state()
    rng = random.Random(config.seed)
    session_ids = [f"soak-{n:04d}" for n in range(config.runs)]
    failing = set(rng.sample(session_ids, round(config.runs * config.follow_up_fail_rate)))
    script = WeatherScript(transient=flaky(config.fail_rate, config.seed))
    server = FakeProviderServer().start()
    server.script = script
    workdir = Path(tempfile.mkdtemp(prefix="lousho-soak-"))
    weather_log = workdir / "weather.jsonl"
    cluster = Cluster(
        workdir,
        extra_env={
            "LOUSHO_AGENTS": "tests.support.weather_agents",
            URL_ENV: server.openai_url,
            LOG_ENV: str(weather_log),
            "LOUSHO_DOCTOR_INTERVAL_S": str(DOCTOR_INTERVAL_S),
        },
    )
    progress = Progress()
    ok = False
    try:
        for index in range(config.workers):
            cluster.start_worker(f"w{index + 1}", concurrency=config.concurrency)
        cluster.start_beat()
        print(
            f"soak: {config.runs} runs over {config.arrival_s:.0f} s, {config.fail_rate:.0%} of model calls failing"
            f" transiently, {len(failing)} follow-ups failing for good; {config.workers} workers x"
            f" c{config.concurrency}; logs in {workdir}",
            flush=True,
        )
        t0_wall, t0 = time.time(), time.monotonic()
        _drive(config, cluster, progress, session_ids, failing, t0, ask, AGENT)
        ok = _report(config, cluster, progress, session_ids, failing, t0_wall, t0, weather_log, script, RECOVER)
    finally:
        cluster.close()
        server.stop()
        if config.keep or not ok:
            print(f"soak: work dir kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0 if ok else 1


def _drive(
    config: Config,
    cluster: Any,
    progress: Progress,
    session_ids: list[str],
    failing: set[str],
    t0: float,
    ask: Any,
    agent: str,
) -> None:
    """Send the runs and the failing follow-ups; return once settled plus ``settle_s``, or at the deadline."""
    deadline = t0 + config.max_seconds
    next_sample = 0.0
    while time.monotonic() < deadline:
        now = time.monotonic() - t0
        for index, sid in enumerate(session_ids):
            if sid not in progress.sent and now >= index * config.arrival_s / config.runs:
                cluster.send(agent, sid, ask(sid, turns=config.turns, ms=config.tool_ms))
                progress.sent[sid] = now
        rows = _rows(cluster.database_url, list(progress.sent))
        progress.note_doctor(cluster.database_url)
        for sid, row in rows.items():
            if sid in failing and sid not in progress.followed_up and _settled(row):
                progress.finished.setdefault(sid, now)
                cluster.send(agent, sid, f"poison follow-up for {sid}: summarise everything again")
                progress.followed_up[sid] = now
            elif _settled(row) and sid not in failing:
                progress.finished.setdefault(sid, now)
            elif _parked(row) and sid in progress.followed_up:
                progress.parked.setdefault(sid, now)
        drained = (
            len(progress.sent) == len(session_ids)
            and all(s in progress.finished for s in session_ids if s not in failing)
            and all(s in progress.parked for s in failing)
        )
        if drained and progress.drained_at is None:
            progress.drained_at = now
            print(
                f"soak: every retryable run finished and every failed one parked at {now:.0f} s;"
                f" watching the sweep for {config.settle_s:.0f} s more",
                flush=True,
            )
        if progress.drained_at is not None and now >= progress.drained_at + config.settle_s:
            return
        if now >= next_sample:
            print(
                f"soak: {now:5.0f} s  sent {len(progress.sent):4d}  finished {len(progress.finished):4d}"
                f"  failed follow-ups parked {len(progress.parked):3d}/{len(failing)}",
                flush=True,
            )
            next_sample += config.window_s
        time.sleep(0.25)
    print(f"soak: stopped at the {config.max_seconds:.0f} s deadline", flush=True)


def _report(
    config: Config,
    cluster: Any,
    progress: Progress,
    session_ids: list[str],
    failing: set[str],
    t0_wall: float,
    t0: float,
    weather_log: Path,
    script: Any,
    recover_task: str,
) -> bool:
    from tests.support.weather_agents import read_events

    rows = _rows(cluster.database_url, session_ids)
    finished = [s for s in session_ids if _settled(rows.get(s)) and s not in failing]
    unfinished_retryable = [s for s in session_ids if s not in failing and not _settled(rows.get(s))]
    unfinished_retryable += [s for s in failing if s not in progress.followed_up]
    pending = {p.session_id: p for p in cluster.client.pending()}
    listed = [
        s
        for s in failing
        if s in pending
        and pending[s].last_error is not None
        and not pending[s].last_error.retryable
        and getattr(pending[s], "state", "parked") == "parked"
    ]
    events = read_events(weather_log)
    sweeps = [e for e in events if e.get("kind") == "publish" and e.get("by") == recover_task]
    logged = []
    for match in _RECOVER_LINE.finditer(cluster.worker_logs()):
        stamp = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()  # local time, as logged
        logged.append((stamp, int(match.group(2))))
    end = time.monotonic() - t0
    calls = Counter(e.get("outcome") for e in events if e.get("kind") == "provider" and e.get("phase") == "end")

    print("\nsoak figures")
    print(
        f"  runs finished                        {len(finished)} of {config.runs - len(failing)} retryable"
        f" (+ {len(failing)} whose first exchange finished before the failing follow-up:"
        f" {len(progress.followed_up)})"
    )
    print(
        f"  retryable runs not finished          {len(unfinished_retryable)} (must be 0)"
        + (f": {sorted(unfinished_retryable)[:10]}" if unfinished_retryable else "")
    )
    print(f"  failed runs listed by pending()      {len(listed)} of {len(failing)} expected (parked, non-retryable)")
    print(f"  provider answers                     {dict(script.answered)}; worker-side call outcomes {dict(calls)}")
    print(
        f"  I19 checker                          {len(progress.doctor_looks)} looks seen, at most"
        f" {progress.unexplained_max} unexplained run(s) (lousho_runs_unexplained, must stay 0)"
    )
    print(
        f"  elapsed                              {end:.0f} s (drained at"
        f" {'never' if progress.drained_at is None else f'{progress.drained_at:.0f} s'})"
    )
    print(
        f"\n  sweep re-sends per minute, by {config.window_s:.0f} s window (publishes by {recover_task};"
        f" 'log' = the workers' 'recover: re-enqueued' lines)"
    )
    print("  window        failed parked   all/min   of parked runs/min   others/min   log/min")
    resent_parked = 0
    window = 0.0
    # A last window shorter than half the others is left out: its rate would be noise.
    while window < end and (end - window >= config.window_s / 2 or window == 0):
        low, high = t0_wall + window, t0_wall + window + config.window_s
        span = min(config.window_s, end - window)
        parked_by = sum(1 for at in progress.parked.values() if at <= window + config.window_s)
        inside = [e for e in sweeps if low <= e["ts"] < high]
        of_parked = [
            e
            for e in inside
            if e.get("run_id") in failing
            and e.get("run_id") in progress.parked
            and e["ts"] >= t0_wall + progress.parked[e["run_id"]]
        ]
        resent_parked += len(of_parked)
        per_minute = 60.0 / max(span, 1e-3)
        in_log = sum(n for stamp, n in logged if low <= stamp < high)
        print(
            f"  {window:4.0f}-{window + span:<4.0f} s  {parked_by:13d}   {len(inside) * per_minute:7.0f}"
            f"   {len(of_parked) * per_minute:18.0f}   {(len(inside) - len(of_parked)) * per_minute:10.0f}"
            f"   {in_log * per_minute:7.0f}"
        )
        window += config.window_s
    checks = {
        "every retryable run finished": not unfinished_retryable,
        "pending() lists every failed run as parked": len(listed) == len(failing),
        "the sweep never re-sent a parked run (flat as they accumulate)": resent_parked == 0,
        "drained before the deadline": progress.drained_at is not None,
        "no unexplained run at any look of the I19 checker": progress.unexplained_max == 0
        and len(progress.doctor_looks) >= 3,
    }
    print()
    for name, passed in checks.items():
        print(f"  {'PASS' if passed else 'FAIL'}  {name}")
    return all(checks.values())


def main(argv: list[str] | None = None) -> int:
    """Run one soak (``python -m bench.soak``); 0 when every check passed."""
    root = Path(__file__).resolve().parent.parent
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return soak(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
