"""``python -m bench.retention``: what a retention pass costs with 100,000 finished runs due in the table.

Recreates its own database (``--database``, ``lousho_bench_retention`` by default; Redis is not used), fills it with
``generate_series`` inserts: ``--runs`` finished runs last saved 31-400 days ago, a sample of them (``--sample``)
with the rows a real run leaves (message rows, history, events, an approval, a send key, two sub-agent runs
each for a tenth of them), runs that must stay (recent, in progress, awaiting approval, aborted, parked, with unread
input), and webhook delivery ids, GitHub body hashes and claimed ticks of all ages. Then it prints the plans of the
batch queries, times ``store.retention`` batches of ``--limit`` until nothing is due, then sweep passes with nothing
due (right after, with the deleted rows' index entries still there, and once vacuumed), and checks that what must
stay stayed. The runs themselves are made by ``bench.stored_runs``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
from datetime import timedelta

import psycopg
from sqlalchemy import Engine, text

from bench.stored_runs import DOCUMENT, MESSAGE
from store import retention
from store.database import make_engine, migrate
from store.settings import Settings

#: Runs that must survive every pass, by kind: (status, extra columns, how many).
_KEPT_RUNS = {
    "recent": "status = 'finished', updated_at = now() - interval '2 days'",
    "progress": "status = 'in-progress'",
    "approval": "status = 'awaiting-approval'",
    "aborted": "aborted = true",
    "parked": """last_error = '{"code": "X", "retryable": false}'""",
    "unread": "status = 'finished', inbox_head = 1",
}


def _fill(conn: psycopg.Connection[object], runs: int, sample: int, kept: int) -> None:
    """Insert the runs, the sample's rows, the runs that stay and the keys."""
    days = "now() - make_interval(days => 31 + (g % 370), secs => g % 86400)"
    conn.execute(f"""INSERT INTO runs (session_id, agent, status, seq, inbox_head, inbox_cursor, document, created_at,
                                       updated_at)
                     SELECT 'job-shop-' || g, 'shop', 'finished', 20, 1, 1, '{DOCUMENT}', {days}, {days}
                     FROM generate_series(1, {runs}) g""")
    chosen = f"generate_series(1, {runs}, {max(1, runs // sample)}) s"
    conn.execute(f"""INSERT INTO run_messages (session_id, slot, seq, message)
                     SELECT 'job-shop-' || s, m, m, '{MESSAGE}' FROM {chosen}, generate_series(0, 19) m""")
    conn.execute(f"""INSERT INTO checkpoint_history (session_id, seq, fence, step, status, document)
                     SELECT 'job-shop-' || s, h, 1, h, 'in-progress', '{DOCUMENT}'
                     FROM {chosen}, generate_series(1, 20) h""")
    conn.execute(f"""INSERT INTO run_events (session_id, seq, type, slot, data)
                     SELECT 'job-shop-' || s, e, 'tool.done', e, '{{"name": "ship", "ms": 12}}'
                     FROM {chosen}, generate_series(0, 29) e""")
    conn.execute(f"""INSERT INTO sends (session_id, idempotency_key, n) SELECT 'job-shop-' || s, 'req-' || s, 1
                     FROM {chosen}""")
    conn.execute(f"""INSERT INTO approvals (approval_id, session_id, tool_call_id, tool_name, args, agent, status,
                                            decided_at)
                     SELECT 'ap-' || s, 'job-shop-' || s, 'call_1', 'ship', '{{"order": 7}}', 'shop', 'approved', now()
                     FROM {chosen}""")
    conn.execute(f"""INSERT INTO runs (session_id, agent, status, seq, document, updated_at, parent_id)
                     SELECT 'job-shop-' || s || '.task-' || lpad(to_hex(c), 16, '0'), 'research', 'finished', 6,
                            '{DOCUMENT}', now() - interval '40 days', 'job-shop-' || s
                     FROM generate_series(1, {runs}, {max(1, runs * 10 // sample)}) s, generate_series(1, 2) c""")
    for kind, columns in _KEPT_RUNS.items():
        conn.execute(f"""INSERT INTO runs (session_id, agent, updated_at, document)
                         SELECT 'kept-{kind}-' || g, 'shop', now() - interval '90 days', '{DOCUMENT}'
                         FROM generate_series(1, {kept}) g""")
        conn.execute(f"UPDATE runs SET {columns} WHERE session_id LIKE 'kept-{kind}-%'")
    conn.execute(f"""INSERT INTO deliveries (agent, delivery_id, session_id, source, body_sha256, received_at)
                     SELECT 'shop', 'd' || g, 'job-shop-' || g, 'standard', md5(g::text), {days}
                     FROM generate_series(1, {runs}) g""")
    conn.execute(f"""INSERT INTO delivery_bodies (agent, body_sha256, delivery_id, received_at)
                     SELECT 'shop', md5(g::text), 'd' || g, {days} FROM generate_series(1, {runs // 5}) g""")
    conn.execute("""INSERT INTO schedules (name, agent, input, every_s, next_fire_at)
                    VALUES ('hourly', 'shop', '[]', 3600, now())""")
    conn.execute(f"""INSERT INTO schedule_fires (schedule_id, fire_at, session_id, outcome, claimed_at)
                     SELECT (SELECT schedule_id FROM schedules), now() - make_interval(hours => g),
                            'sched-1-' || g, 'fired', now() - make_interval(hours => g)
                     FROM generate_series(1, {runs // 10}) g""")


def _plans(engine: Engine, policy: retention.Retention) -> None:
    """The plan of each batch's row selection: the index it reads (never a sequential scan of a big table)."""
    plans = retention.batch_plans(engine, policy.runs or timedelta(0), keys_older_than=policy.keys)
    for name, plan in plans.items():
        print(f"plan of the {name} batch: " + " / ".join(line.strip() for line in plan[:4]))


def _time_batches(
    engine: Engine, prune_batch: retention.Batch, age: timedelta, limit: int
) -> tuple[list[float], retention.PruneResult]:
    """Run batches until one is not full; the seconds of each and what they pruned."""
    times, total = [], retention.PruneResult()
    while True:
        started = time.perf_counter()
        done = prune_batch(engine, age, limit)
        times.append(time.perf_counter() - started)
        total += done
        if not done.more:
            return times, total


def _summary(times: Sequence[float]) -> str:
    ordered = sorted(times)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    first, last = statistics.median(times[:10]), statistics.median(times[-10:])
    return (
        f"{len(times)} batches in {sum(times):.2f} s: median {statistics.median(times) * 1000:.0f} ms,"
        f" p95 {p95 * 1000:.0f} ms, max {max(times) * 1000:.0f} ms; median of the first 10 {first * 1000:.0f} ms,"
        f" of the last 10 {last * 1000:.0f} ms"
    )


def _idle(engine: Engine, policy: retention.Retention, limit: int) -> str:
    """20 sweep passes with nothing due: their median and longest time."""
    idle = []
    for _ in range(20):
        started = time.perf_counter()
        retention.sweep(engine, policy, limit)
        idle.append(time.perf_counter() - started)
    return f"median {statistics.median(idle) * 1000:.1f} ms, max {max(idle) * 1000:.1f} ms (runs and keys, 20 passes)"


def main(argv: Sequence[str] | None = None) -> int:
    """Fill the database, time the passes, print the figures; 1 when something that must stay was pruned."""
    parser = argparse.ArgumentParser(prog="python -m bench.retention", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--server-url", default=os.environ.get("LOUSHO_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    )
    parser.add_argument("--database", default="lousho_bench_retention")
    parser.add_argument("--runs", type=int, default=100_000, help="finished runs due (default 100000)")
    parser.add_argument("--sample", type=int, default=2_000, help="of them, runs with realistic rows (default 2000)")
    parser.add_argument("--kept", type=int, default=1_000, help="runs of each kind that must stay (default 1000)")
    parser.add_argument("--limit", type=int, default=retention.BATCH, help="runs per batch (default 500)")
    args = parser.parse_args(argv)
    base = args.server_url.split("?")[0].rsplit("/", 1)[0]
    with psycopg.connect(f"{base}/postgres", autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{args.database}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{args.database}"')
    settings = Settings(database_url=f"{base}/{args.database}")
    migrate(settings)
    started = time.perf_counter()
    with psycopg.connect(settings.database_url, autocommit=True) as conn:
        _fill(conn, args.runs, args.sample, args.kept)
        conn.execute("VACUUM ANALYZE")
        counts = {
            table: conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]  # type: ignore[index]
            for table in (
                "runs",
                "run_messages",
                "checkpoint_history",
                "run_events",
                "approvals",
                "deliveries",
                "delivery_bodies",
                "schedule_fires",
            )
        }
    print(f"filled in {time.perf_counter() - started:.1f} s: " + ", ".join(f"{t} {n}" for t, n in counts.items()))
    engine = make_engine(settings)
    policy = retention.Retention.from_days(30)
    try:
        _plans(engine, policy)
        due = retention.count_due(engine, policy.runs or timedelta(0), keys_older_than=policy.keys)
        print(
            f"due: {due.runs} runs (sub-agent runs included), {due.deliveries} delivery ids, {due.bodies} body"
            f" hashes, {due.ticks} ticks"
        )
        times, pruned = _time_batches(engine, retention.prune_runs, policy.runs or timedelta(0), args.limit)
        print(f"runs, limit {args.limit}: {_summary(times)}")
        print(
            "  pruned "
            + ", ".join(f"{name} {value}" for name, value in pruned.model_dump().items() if name != "more" and value)
        )
        key_times, keys = _time_batches(engine, retention.prune_keys, policy.keys or timedelta(0), args.limit)
        print(
            f"keys, limit {args.limit}: {_summary(key_times)}; pruned {keys.deliveries} delivery ids,"
            f" {keys.bodies} body hashes, {keys.ticks} ticks"
        )
        print(f"a sweep pass with nothing due, right after: {_idle(engine, policy, args.limit)}")
        with psycopg.connect(settings.database_url, autocommit=True) as conn:
            conn.execute("VACUUM runs, deliveries, delivery_bodies, schedule_fires")
        print(f"a sweep pass with nothing due, once vacuumed: {_idle(engine, policy, args.limit)}")
        with engine.connect() as conn:
            left = conn.execute(text("SELECT count(*) FROM runs WHERE session_id LIKE 'kept-%'")).scalar_one()
    finally:
        engine.dispose()
    expected = args.kept * len(_KEPT_RUNS)
    print(f"runs that must stay: {left} of {expected} stayed")
    return 0 if left == expected else 1


if __name__ == "__main__":
    sys.exit(main())
