"""``python -m bench.scale``: whether the bounded operations cost the same with 1,000 and with 100,000 stored runs.

For each size (``--sizes``), recreates its own database (``--database``, ``lousho_bench_scale`` by default; Redis
is not used), fills it with ``bench.stored_runs.fill_mix`` (runs in every state, sub-agent runs, history, events,
approvals; the work the bounded operations find is the same at every size) and times, ``--repeat`` times each
after five untimed ones, the store calls behind: the recovery sweep's statements (its report of recovered runs, the
approvals' expiry, the first page of due runs, marking that page swept, the leads whose wake-up was lost; its
wake-up of model-slot waiters reads only Redis), the first page of ``pending``, the first page of the runs listing,
the Postgres side of ``describe`` of a paused run and of a lead paused on its child's approval, and one retention
pass with one cohort of 50 old runs due (the next cohort is stored, untimed, after each pass). Prints a table of
the medians at each size, the ratio of the largest size's to the smallest's, and the top node of each operation's
costliest statement; ``--explain`` prints every statement's ``EXPLAIN ANALYZE`` too (run in a transaction that is
rolled back). Exits 1 when an operation's ratio is over ``TARGET_RATIO``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
from psycopg.rows import TupleRow
from sqlalchemy import Engine, event

from bench.stored_runs import Mix, add_cohort, fill_mix, state_of, touch_moving
from store import observed, retention
from store.checkpoints import PostgresCheckpointStore
from store.database import Transaction, make_engine, migrate
from store.settings import Settings

#: Issue 31's target: each bounded operation at the largest size within this many times its cost at the smallest.
TARGET_RATIO = 1.5
#: Runs a recovery sweep page holds (``worker.tasks.SWEEP_LIMIT``).
SWEEP_LIMIT = 500
#: The fewest runs a size may have: below, ``fill_mix`` has too few runs in some state for its fixed counts.
MIN_SIZE = 500
#: Runs of each operation before the timed ones (psycopg prepares a statement at its fifth).
_WARM_UP = 5
#: Runs on a first page of ``pending`` and of the runs listing (a page every size fills).
PAGE = 50
#: Agents whose recoveries the sweep reports (``fill_mix``'s four and the sub-agents').
_AGENTS = ["agent-0", "agent-1", "agent-2", "agent-3", "research"]
#: Age of retention cohort ``c`` in days (``add_cohort``): a pass with ``older_than`` just under it prunes that one.
_COHORT_DAYS = 400
#: Finished runs of their own in a retention cohort: what one retention pass finds due (with 10 sub-agent runs).
_COHORT_RUNS = 50


@dataclass(frozen=True)
class Statement:
    """One statement an operation sent, as the driver got it."""

    sql: str
    params: Any


@dataclass
class Operation:
    """A bounded operation: ``action`` is timed; ``reset`` (untimed) puts back what it changed."""

    name: str
    action: Callable[[], object]
    reset: Callable[[], object] | None = None
    #: Parameters replacing the captured ones when the plans are explained (an operation that used up its rows).
    explain_params: Callable[[], dict[str, Any]] = dict


@dataclass
class Measured:
    """What one operation cost at one size."""

    times_ms: list[float]
    plan: str

    @property
    def median_ms(self) -> float:
        """The median of the timed repetitions."""
        return statistics.median(self.times_ms)


@contextmanager
def _captured(engine: Engine) -> Iterator[list[Statement]]:
    """The statements sent through ``engine`` (and the engines made from it) while the block runs."""
    sent: list[Statement] = []

    def keep(conn: Any, cursor: Any, sql: str, params: Any, context: Any, executemany: bool) -> None:
        sent.append(Statement(sql, params))

    event.listen(engine, "before_cursor_execute", keep)
    try:
        yield sent
    finally:
        event.remove(engine, "before_cursor_execute", keep)


def _is_setting(sql: str) -> bool:
    return sql.lstrip().upper().startswith(("SET ", "BEGIN", "COMMIT", "ROLLBACK"))


def _params(statement: Statement, overrides: dict[str, Any]) -> Any:
    if overrides and isinstance(statement.params, dict):
        return {**statement.params, **{k: v for k, v in overrides.items() if k in statement.params}}
    return statement.params


def _top_node(plan: dict[str, Any]) -> str:
    """The plan's top node and the first table or index it reads, outer side first (``Limit / Index Scan on x``).

    Scans of a subquery's or a CTE's rows are passed through: they read what the nodes under them read.
    """
    stack, scan = [plan], ""
    while stack and not scan:
        node = stack.pop()
        on = node.get("Index Name") or node.get("Relation Name")
        if "Scan" in node["Node Type"] and on:
            scan = f"{node['Node Type']} on {on}"
        stack.extend(reversed(node.get("Plans", [])))
    top = plan["Node Type"]
    return scan if scan.startswith(top) else f"{top} / {scan or '-'}"


def _explain(
    engine: Engine, statements: Sequence[Statement], overrides: dict[str, Any], analyze: bool
) -> tuple[str, list[str]]:
    """The top node of the costliest statement, and with ``analyze`` each statement's plan as run (rolled back)."""
    costliest, top, shown = -1.0, "", []
    connection = engine.raw_connection()
    try:
        cursor = connection.cursor()
        for statement in statements:
            params = _params(statement, overrides)
            if _is_setting(statement.sql):
                cursor.execute(statement.sql, params)
                continue
            cursor.execute(f"EXPLAIN (FORMAT JSON) {statement.sql}", params)
            plan = cursor.fetchall()[0][0][0]["Plan"]
            if plan["Total Cost"] > costliest:
                costliest, top = plan["Total Cost"], _top_node(plan)
            if analyze:
                cursor.execute(f"EXPLAIN (ANALYZE, BUFFERS) {statement.sql}", params)
                lines = "\n".join(f"    {row[0]}" for row in cursor.fetchall())
                shown.append(f"  {' '.join(statement.sql.split())[:150]}\n{lines}")
    finally:
        connection.rollback()
        connection.close()
    return top, shown


def _measure(engine: Engine, operation: Operation, repeat: int, analyze: bool) -> tuple[Measured, list[str]]:
    """Warm up (capturing the statements), then time ``repeat`` repetitions; the plan read after."""
    times: list[float] = []
    with _captured(engine) as statements:
        _run(operation, times)
    # psycopg prepares a statement at its fifth run on a connection: the timed runs are all prepared ones.
    for _ in range(_WARM_UP - 1):
        _run(operation, times)
    times.clear()
    for _ in range(repeat):
        _run(operation, times)
    top, shown = _explain(engine, statements, operation.explain_params(), analyze)
    return Measured(times, top), shown


def _run(operation: Operation, times: list[float]) -> None:
    """Run ``operation`` once, adding its time in milliseconds to ``times``, then reset what it changed."""
    started = time.perf_counter()
    operation.action()
    times.append((time.perf_counter() - started) * 1000)
    if operation.reset is not None:
        operation.reset()


def _operations(engine: Engine, settings: Settings, conn: psycopg.Connection[TupleRow]) -> list[Operation]:
    """The bounded operations on a database ``fill_mix`` filled with one retention cohort."""
    store = PostgresCheckpointStore(engine, settings.history_limit)
    stale = max(settings.lease_ttl_ms / 1000, 0.5)
    page: list[str] = []

    def due() -> object:
        page[:] = [run.session_id for run in store.due_runs(stale, SWEEP_LIMIT)]
        return page

    def unmark() -> None:
        conn.execute("UPDATE runs SET swept_at = NULL, recovery = NULL WHERE session_id = ANY(%s)", (page,))

    def first(state: str, status: str) -> str:
        # No parameters: ``state_of`` has ``%`` operators, and the status is one of ours.
        row = conn.execute(
            f"SELECT r.session_id FROM runs r WHERE {state_of(state)} AND r.status = '{status}'"
            " ORDER BY r.session_id LIMIT 1"
        ).fetchone()
        if row is None:
            raise SystemExit(f"no {state} run with status {status} to describe")
        return str(row[0])

    def describe(session_id: str) -> Callable[[], object]:
        def read() -> object:
            with Transaction(engine) as tx:
                return observed.one(tx, session_id, settings), observed.business_state(tx, session_id)

        return read

    cohorts = [0]

    def age() -> timedelta:
        # Just under the age of the one cohort stored: what a pass finds due is that cohort.
        return timedelta(days=_COHORT_DAYS - cohorts[-1], hours=-12)

    def prune() -> object:
        return retention.sweep(engine, retention.Retention.of(age()))

    def next_cohort() -> None:
        cohorts.append(cohorts[-1] + 1)
        add_cohort(conn, cohorts[-1], _COHORT_RUNS)

    due()
    return [
        Operation("sweep: report recoveries", lambda: store.settle_recoveries(_AGENTS, SWEEP_LIMIT)),
        Operation("sweep: expire approvals", lambda: store.expire_approvals(SWEEP_LIMIT)),
        Operation("sweep: due runs, first page", due),
        Operation("sweep: mark the page swept", lambda: store.mark_swept(page), reset=unmark),
        Operation("sweep: waiting leads", lambda: store.waiting_leads(stale, SWEEP_LIMIT)),
        Operation(f"pending, first {PAGE}", lambda: store.pending(limit=PAGE)),
        Operation(f"runs listing, first {PAGE}", lambda: store.list_runs(limit=PAGE, details=True)),
        Operation("describe a paused run", describe(first("awaiting-approval", "awaiting-approval"))),
        Operation("describe a lead paused on a child", describe(first("waiting", "awaiting-approval"))),
        Operation(
            "retention pass, one cohort due",
            prune,
            reset=next_cohort,
            explain_params=lambda: {"age": age().total_seconds()},
        ),
    ]


def _fill(settings: Settings, database: str, size: int) -> Mix:
    base = settings.database_url.rsplit("/", 1)[0]
    with psycopg.connect(f"{base}/postgres", autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{database}"')
    migrate(settings)
    with psycopg.connect(settings.database_url, autocommit=True) as conn:
        mix = fill_mix(conn, size, cohorts=1, cohort_runs=_COHORT_RUNS)
        conn.execute("VACUUM ANALYZE")
        try:
            # The fill's pages are written out now, not by the checkpointer while commits are timed.
            conn.execute("CHECKPOINT")
        except psycopg.errors.InsufficientPrivilege:
            print("no CHECKPOINT (needs pg_checkpoint): commits timed soon after the fill may wait on its writes")
    return mix


def measure_size(
    server_url: str, database: str, size: int, repeat: int, analyze: bool
) -> tuple[Mix, dict[str, Measured]]:
    """Fill a database of ``size`` runs and measure every operation on it (printing plans with ``analyze``)."""
    base = server_url.split("?")[0].rsplit("/", 1)[0]
    settings = Settings(database_url=f"{base}/{database}")
    started = time.perf_counter()
    mix = _fill(settings, database, size)
    print(f"{size} runs: filled in {time.perf_counter() - started:.1f} s, {mix.total_runs} run rows", flush=True)
    engine = make_engine(settings)
    results: dict[str, Measured] = {}
    try:
        with psycopg.connect(settings.database_url, autocommit=True) as conn:
            # The sweep's operations come first, while the runs saved just now are still inside a lease TTL; the
            # index entries of their previous versions are vacuumed, as a live table's are behind its saves.
            touch_moving(conn)
            conn.execute("VACUUM runs")
            for operation in _operations(engine, settings, conn):
                results[operation.name], shown = _measure(engine, operation, repeat, analyze)
                if shown:
                    print(f"{operation.name} at {size} runs:\n" + "\n".join(shown))
    finally:
        engine.dispose()
    return mix, results


def table(sizes: Sequence[int], results: dict[int, dict[str, Measured]]) -> list[str]:
    """The table's lines: each operation's median at each size, the ratio, the plan's top node at the largest."""
    large = max(sizes)
    heads = [f"{size:,} runs (ms)" for size in sizes]
    names = list(results[large])
    width = max(len(name) for name in names)
    lines = [f"{'operation':<{width}}  " + "  ".join(f"{h:>18}" for h in heads) + f"  {'ratio':>7}  plan (top node)"]
    for name in names:
        medians = [results[size][name].median_ms for size in sizes]
        ratio = _ratio(results, sizes, name)
        mark = " " if ratio <= TARGET_RATIO else "!"
        lines.append(
            f"{name:<{width}}  "
            + "  ".join(f"{ms:>18.2f}" for ms in medians)
            + f"  {ratio:>6.2f}{mark}  {results[large][name].plan}"
        )
    return lines


def _report(sizes: Sequence[int], mixes: dict[int, Mix], results: dict[int, dict[str, Measured]]) -> dict[str, Any]:
    large = max(sizes)
    return {
        "sizes": list(sizes),
        "target_ratio": TARGET_RATIO,
        "mix": {str(size): {**mix.states, "sub-agent runs": mix.children} for size, mix in mixes.items()},
        "operations": [
            {
                "name": name,
                "median_ms": {str(size): round(results[size][name].median_ms, 3) for size in sizes},
                "ratio": round(_ratio(results, sizes, name), 3),
                "plan": {str(size): results[size][name].plan for size in sizes},
                "times_ms": {str(size): [round(t, 3) for t in results[size][name].times_ms] for size in sizes},
            }
            for name in results[large]
        ],
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Measure every size, print the table (and write it as JSON); 1 when an operation is over the target."""
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--server-url", default=os.environ.get("LOUSHO_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    )
    parser.add_argument("--database", default="lousho_bench_scale")
    parser.add_argument("--sizes", default="1000,100000", help="stored runs, comma-separated (default 1000,100000)")
    parser.add_argument("--repeat", type=int, default=50, help="timed repetitions of each operation (default 50)")
    parser.add_argument("--explain", action="store_true", help="print each statement's EXPLAIN ANALYZE")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)
    sizes = sorted({int(size) for size in args.sizes.split(",")})
    if len(sizes) < 2 or sizes[0] < MIN_SIZE:
        parser.error(f"--sizes takes two sizes or more, each at least {MIN_SIZE}")
    mixes, results = {}, {}
    for size in sizes:
        mixes[size], results[size] = measure_size(args.server_url, args.database, size, args.repeat, args.explain)
    print("\n".join(table(sizes, results)))
    over = [name for name in results[sizes[-1]] if _ratio(results, sizes, name) > TARGET_RATIO]
    print(
        f"target: each within {TARGET_RATIO}x from {sizes[0]:,} to {sizes[-1]:,} runs: "
        + ("met" if not over else f"MISSED by {', '.join(over)}")
    )
    if args.json is not None:
        args.json.write_text(json.dumps(_report(sizes, mixes, results), indent=2) + "\n")
    return 1 if over else 0


def _ratio(results: dict[int, dict[str, Measured]], sizes: Sequence[int], name: str) -> float:
    """The median at the largest size over the median at the smallest."""
    return results[max(sizes)][name].median_ms / results[min(sizes)][name].median_ms


if __name__ == "__main__":
    sys.exit(main())
