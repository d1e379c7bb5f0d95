"""Postgres crash with runs in flight (RELIABILITY C8): ``pg_ctl stop -m immediate``, down 3 s, started again.

Twenty runs of several tool turns are in flight on two real workers (``-c 3`` each) when a private
Postgres server (``tests.support.private_postgres``, never the machine's own) is stopped the way a
crash stops it. Every pooled connection of the workers dies with it. After 3 s it is started again
on the same port and data folder and replays its WAL. Steps that were running fail.

For 0.6 s before the crash, commits get no answer (``PrivatePostgres.hold_commits``: they wait for a
synchronous standby that never connects), so the saves sent then are committed in the WAL while
their workers never learn it: commit-unknown saves, replayed by the restart. The checker's
invariants hold over the whole history with them: each call's result recorded once (I1), no
recorded result run again (I2), no recorded turn generated again (I3), valid transcripts (I4),
fenced history (I7), every run finished (I10). Four runs have an approval-gated call, approved as
soon as it is asked for, and the server dies while one of them runs (I5: it then gets one real or
``interrupted`` result, never a second execution).

It fails when a run is lost or parked, not finished 60 s after the server is back, or recovers
slower than I11's budget; when a tool runs twice except for an execution the outage cut off; when
a worker process takes no step after the restart (a wedged one); or when the crash hit nothing
(no run in flight, no step failed, no save left commit-unknown).

Figures printed: commit-unknown saves, failed steps (worker log lines by kind, ``last_error``
records seen), recovery p50/p99/max from the server being back to each run's next save, raw
re-executions, wasted model calls, each worker's first step after the restart, runs lost (must be 0).
"""

from __future__ import annotations

import math
import re
import time
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest

from producer.client import Client
from store import errors
from tests.support import checker, services
from tests.support.agents import run_input
from tests.support.cluster import Cluster, RecoveryBudget, wait_until
from tests.support.private_postgres import PrivatePostgres, migrated

pytestmark = pytest.mark.crash

RUNS = 20
#: The first runs each have one approval-gated call that runs 1.5 s once approved.
GATED = 4
WORKERS = ("w1", "w2")
CONCURRENCY = 3
DOWN_S = 3.0
#: Every run must be finished this long after the server is back.
FINISH_WITHIN_S = 60.0
#: 8 model turns and 7 tool batches of 2-3 calls each: about 4 s of work per run, 14 s for all of them.
RUN_SHAPE = {"turns": 8, "calls": "3,2", "sleep": "150-400"}
GATE = {"gate": "1.0", "slow": "1.0:1500"}
#: The crash comes this long after the sends at the earliest (every run under way) ...
WARMUP_S = 2.0
#: ... and once an approved call runs, waiting at most this long for one.
APPROVED_CALL_WAIT_S = 20.0
#: How long commits get no answer before the crash (``PrivatePostgres.hold_commits``): long enough
#: for most busy pool processes to send a save.
HOLD_S = 0.6
#: An execution the outage cut off ended after the commits were held, or at most this long before
#: (its result save still on the wire).
CUT_OFF_SLACK_S = 1.0
#: After the restart the sweep sends every run at once: a run waits behind up to this many steps.
QUEUED_STEPS = math.ceil((RUNS - 1) / (len(WORKERS) * CONCURRENCY))
#: Scheduling noise on a loaded 2-core machine (as in the chaos test).
LOADED_MACHINE_S = 1.0

_STAMP = r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+): \w+/([^\]]+)\] "
_OUTCOME = re.compile(_STAMP + r"advance (\S+) seq=\S+ -> ([\w-]+)")
#: Kinds of failed steps and sweeps in the worker logs.
_FAILURES = {
    "step could not reach a service": re.compile(r"step of \S+ could not reach a service"),
    "step failed, recorded": re.compile(r"step of \S+ failed: "),
    "step raised": re.compile(r"Task (?:lousho\.advance|[A-Za-z0-9_.-]+: [a-z -]+)\[[0-9a-f-]+\] raised unexpected"),
    "sweep raised": re.compile(r"Task lousho\.recover\[[0-9a-f-]+\] raised unexpected"),
}
#: Outcomes of steps that saved something.
_SAVED = {"advanced", "finished", "awaiting-approval"}


class PrivateCluster(Cluster):
    """A ``Cluster`` whose workers, beat, producer and checks use the database named in ``extra_env``."""

    @property
    def database_url(self) -> str:
        """The private server's test database."""
        return self.extra_env["LOUSHO_DATABASE_URL"]

    @property
    def client(self) -> Client:
        """A producer on the private server's test database."""
        if self._client is None:
            self._client = Client(services.test_settings(database_url=self.database_url))
        return self._client


@pytest.fixture
def postgres(tmp_path: Path) -> Iterator[PrivatePostgres]:
    """A private Postgres server with a migrated test database; stopped and killed at the end."""
    with migrated(tmp_path / "postgres") as server:
        yield server


@pytest.fixture
def cluster(tmp_path: Path, postgres: PrivatePostgres, request: pytest.FixtureRequest) -> Iterator[PrivateCluster]:
    """Workers and a beat on the private server (and the test Redis db); every process killed at the end."""
    made = PrivateCluster(tmp_path / "cluster", extra_env={"LOUSHO_DATABASE_URL": postgres.url(services.TEST_DATABASE)})
    failed_before = request.session.testsfailed
    try:
        yield made
    finally:
        if request.session.testsfailed > failed_before:
            made.dump_logs()
            print(f"--- postgres.log ---\n{postgres.log_tail(30)}")
            print(f"logs and events kept in {made.workdir}")
        made.close()


def _log_lines(text: str, pattern: re.Pattern[str], since: float) -> list[re.Match[str]]:
    """Matches of ``pattern`` logged at or after ``since`` (log times are local time)."""
    return [
        m for m in pattern.finditer(text) if datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() >= since
    ]


def _running_approved_call(cluster: Cluster) -> bool:
    """Whether an approved call has started and not ended."""
    tools = [e for e in cluster.events() if e.get("kind") == "tool"]
    ended = {e["exec"] for e in tools if e["phase"] == "end"}
    return any(e["phase"] == "start" and e.get("approved") and e["exec"] not in ended for e in tools)


def _statement_kind(query: str) -> str:
    """A step's save, a step's claim of the fence, or another statement."""
    if "UPDATE runs SET status" in query:
        return "save"
    return "claim" if "UPDATE runs SET fence" in query else "other"


def _saves_before(cluster: Cluster, run_ids: Sequence[str], ts: float) -> int:
    """Visible history entries of ``run_ids`` whose transaction started before ``ts`` (epoch seconds)."""
    with psycopg.connect(cluster.database_url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM checkpoint_history WHERE session_id = ANY(%s) AND saved_at < to_timestamp(%s)",
            (list(run_ids), ts),
        ).fetchone()
    return int(row[0]) if row else 0


def _unfinished_at(cluster: Cluster, run_ids: Sequence[str], ts: float) -> tuple[str, ...]:
    """Runs whose last save committed before ``ts`` (epoch seconds) did not finish them, or that had none."""
    with psycopg.connect(cluster.database_url) as conn:
        rows = conn.execute(
            "SELECT DISTINCT ON (session_id) session_id, status FROM checkpoint_history"
            " WHERE session_id = ANY(%s) AND saved_at < to_timestamp(%s)"
            " ORDER BY session_id, seq DESC",
            (list(run_ids), ts),
        ).fetchall()
    finished = {sid for sid, status in rows if status == "finished"}
    return tuple(s for s in run_ids if s not in finished)


def _unexplained_reexecutions(events: Sequence[dict[str, Any]], outage_at: float, back_at: float) -> list[str]:
    """Calls that ran more than once although their earlier executions were not cut off by the outage.

    A cut-off execution started before the server was back and ended after the outage began (or
    just before, its result save still on the wire), or never ended.
    """
    executions: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    ends = {e["exec"]: e["ts"] for e in events if e.get("kind") == "tool" and e.get("phase") == "end"}
    for event in events:
        if event.get("kind") == "tool" and event.get("phase") == "start":
            executions[(event["run_id"], event["tool_call_id"])].append(event)
    unexplained = []
    for (run_id, call_id), started in sorted(executions.items()):
        for earlier in sorted(started, key=lambda e: e["ts"])[:-1]:
            ended = ends.get(earlier["exec"])
            if earlier["ts"] >= back_at or (ended is not None and ended < outage_at - CUT_OFF_SLACK_S):
                unexplained.append(
                    f"{run_id}/{call_id}: execution {earlier['exec']} at "
                    f"{earlier['ts'] - outage_at:+.2f} s from the outage, ended "
                    f"{'never' if ended is None else f'{ended - outage_at:+.2f} s'}"
                )
    return unexplained


def _first_steps(cluster: Cluster, back_at: float) -> dict[str, dict[str, float]]:
    """Worker name -> pool process -> seconds from the restart to its first step that saved."""
    firsts: dict[str, dict[str, float]] = {}
    for worker in cluster.workers:
        found: dict[str, float] = {}
        for match in _log_lines(worker.log_path.read_text(errors="replace"), _OUTCOME, back_at):
            if match.group(4) in _SAVED:
                stamp = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                found.setdefault(match.group(2), round(stamp - back_at, 3))
        firsts[worker.name] = found
    return firsts


def _recovery_budget(cluster: Cluster) -> RecoveryBudget:
    """I11 (lease TTL + sweep + one step at this run's step p99), plus the queue behind the other runs."""
    steps = cluster.step_times()
    step_p50, step_p99 = checker.percentile(steps, 50) or 0.0, checker.percentile(steps, 99) or 0.0
    return cluster.recovery_budget(step_p99, round(QUEUED_STEPS * step_p50 + LOADED_MACHINE_S, 3))


def test_postgres_crash_loses_no_run_and_repeats_no_recorded_work(
    postgres: PrivatePostgres, cluster: PrivateCluster
) -> None:
    for worker in [cluster.start_worker(name, concurrency=CONCURRENCY, wait=False) for name in WORKERS]:
        cluster.wait_ready(worker)
    cluster.start_beat()
    run_ids = [f"pg-{n:02d}" for n in range(RUNS)]
    for n, run_id in enumerate(run_ids):
        cluster.send("chaos", run_id, run_input(run_id, **RUN_SHAPE, **(GATE if n < GATED else {})))
    sent = time.monotonic()

    def ready_to_crash() -> bool:
        cluster.approve_pending("chaos")
        return time.monotonic() - sent >= WARMUP_S and _running_approved_call(cluster)

    wait_until(ready_to_crash, APPROVED_CALL_WAIT_S, "an approved call to run", interval=0.1)
    # The saves sent from now on commit but get no answer: the crash leaves their outcome unknown.
    postgres.hold_commits()
    held_at = time.time()
    time.sleep(HOLD_S)
    held = Counter(_statement_kind(query) for query in postgres.held_commits())
    visible_at_crash = _saves_before(cluster, run_ids, time.time() + 60)
    leases_at_crash = len(cluster.lease_holders())
    old_pid = postgres.pid()

    crashed_at = postgres.crash()
    time.sleep(max(0.0, crashed_at + DOWN_S - time.time()))
    restart_at = time.time()
    back_at = postgres.start()
    assert postgres.pid() not in (None, old_pid)

    last_errors: dict[str, Any] = {}
    producer_errors: Counter[str] = Counter()

    def poll() -> None:
        try:
            cluster.approve_pending("chaos")
        except errors.StorageError as exc:  # the producer's own reconnection, retried at the next poll
            producer_errors[exc.code] += 1
        for sid, status in cluster.statuses(run_ids).items():
            if status["last_error"] is not None:
                last_errors.setdefault(sid, status["last_error"])

    drained = cluster.wait_finished(run_ids, timeout=FINISH_WITHIN_S, on_poll=poll)
    # Recovery counts from the server being back, for every run the crash left unfinished.
    in_flight = _unfinished_at(cluster, run_ids, crashed_at)
    # Saves that committed without their worker being told: invisible before the crash, replayed after it.
    unknown_saves = _saves_before(cluster, run_ids, crashed_at) - visible_at_crash
    cluster.faults.append(checker.Fault(back_at, "postgres-restart", (postgres.pid() or 0,), in_flight))

    report = checker.check(cluster.database_url, cluster.log_path, expected=run_ids, faults=cluster.faults)
    checker.print_report(report, "postgres crash: pg_ctl stop -m immediate, down 3 s, start")
    logs = cluster.worker_logs()
    failures = {kind: len(pattern.findall(logs)) for kind, pattern in _FAILURES.items()}
    failed_steps = sum(n for kind, n in failures.items() if kind.startswith("step"))
    events = cluster.events()
    unexplained = _unexplained_reexecutions(events, held_at, back_at)
    firsts = _first_steps(cluster, back_at)
    recovery = report["recovery"]
    budget = _recovery_budget(cluster)
    statuses = cluster.statuses(run_ids)
    lost = [s for s in run_ids if statuses.get(s, {}).get("status") != "finished"]
    parked = [s for s, st in statuses.items() if st["last_error"] is not None]
    outcomes = cluster.outcomes()
    print(
        f"in flight at the crash: {len(in_flight)} runs, {leases_at_crash} leases held;"
        f" down {restart_at - crashed_at:.2f} s, accepting connections {back_at - crashed_at:.2f} s"
        f" after the crash; all finished {drained:.1f} s after it was back"
    )
    print(
        f"commit-unknown at the crash: {held['save']} saves, {held['claim']} claims, {held['other']} other"
        f" statements waiting for an answer; saves committed unseen and replayed after the restart: {unknown_saves}"
    )
    print(
        f"failed steps: {failed_steps} ({failures}); last_error records seen: {len(last_errors)}"
        f" {sorted({str(e.get('code')) for e in last_errors.values()})}; producer errors: {dict(producer_errors)}"
    )
    print(
        f"recovery after the restart: p50 {recovery['p50_s']} s, p99 {recovery['p99_s']} s,"
        f" max {recovery['max_s']} s over {recovery['count']} runs (budget {budget})"
    )
    print(
        f"raw re-executions: {report['raw_reexecutions']} (not cut off by the outage: {len(unexplained)});"
        f" wasted model calls: {report['wasted_model_calls']}; interrupted results: {report['interrupted_results']}"
    )
    print(
        "first saving step after the restart: "
        + "; ".join(
            f"{name}: {min(found.values(), default=None)} s ({dict(sorted(found.items()))})"
            for name, found in firsts.items()
        )
    )
    print(f"step outcomes: {dict(outcomes)}; lost: {len(lost)}; parked: {len(parked)}")
    for slow in recovery["slowest"][:1]:
        print(f"slowest recovery: {slow['run']}, {slow['recovery_s']} s\n" + cluster.explain(slow["run"], back_at, 4.0))

    checker.assert_clean(report)
    assert not lost and report["finished"] == RUNS, lost
    assert not parked and outcomes["parked"] == 0, parked
    # The crash hit work in flight (else the test proves nothing): runs under way, steps failed.
    assert len(in_flight) >= RUNS // 2, in_flight
    assert failed_steps >= 1, failures
    assert held["save"] >= 1, f"no save was waiting for its commit at the crash: {held}"
    # Every held save is in the history after the restart, and the checks above covered it.
    assert unknown_saves >= held["save"], (unknown_saves, held)
    assert not unexplained, "tools ran again though the outage did not cut them off:\n" + "\n".join(unexplained)
    assert recovery["count"] == len(in_flight) and not recovery["unrecovered"], recovery
    assert recovery["p99_s"] is not None and recovery["p99_s"] <= budget.limit_s
    # No pool process stays wedged on a dead connection: each one saved work after the restart.
    for worker in cluster.workers:
        assert worker.alive(), f"worker {worker.name} exited"
        assert len(firsts[worker.name]) >= CONCURRENCY, f"{worker.name}: pool processes that saved work: {firsts}"
