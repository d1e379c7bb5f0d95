"""What Lousho runs leave in Postgres and write to its WAL (``--storage``): bytes per table and per step.

``stored`` sums ``pg_column_size`` of the rows the measured runs of one length left in each table the run's
state lives in; ``wal_run`` sends one run alone and samples the server's WAL position with the run's seq, so
``wal_windows`` can tell the WAL bytes per step early in the run from those late in it. The printing of both
is here too; the rounds themselves are taken by ``bench.run``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from bench import agents as bench_agents
from bench.workers import BenchError

#: The tables a run's state lives in; ``run_messages`` (one row per transcript message) and ``run_events`` (its
#: durable events) may not exist in another tree's schema.
TABLES = ("runs", "checkpoint_history", "inbox", "run_messages", "run_events")
#: The production default of ``history_limit``: how many history rows a run keeps outside the bench.
PRODUCTION_HISTORY = 50
BACKGROUND_S = 1.0
POLL_S = 0.02

Windows = dict[str, dict[str, float] | None]  # a run's parts by name: WAL figures, None without a step


@dataclass
class Stored:
    """The rows the runs of one system and length left, per table: count and bytes (None: no such table)."""

    system: str
    length: int
    runs: int
    tables: dict[str, tuple[int, int] | None]
    history_newest_bytes: int  # the newest PRODUCTION_HISTORY history rows of each run only

    @property
    def steps(self) -> int:
        """Steps of the runs measured."""
        return self.runs * self.length

    @property
    def total_bytes(self) -> int:
        """Bytes of every row of the runs, in every table there is."""
        return sum(size for _, size in (v for v in self.tables.values() if v is not None))

    @property
    def total_newest_bytes(self) -> int:
        """``total_bytes`` with only the newest ``PRODUCTION_HISTORY`` history rows of each run counted."""
        history = self.tables.get("checkpoint_history")
        return self.total_bytes - (history[1] if history else 0) + self.history_newest_bytes

    def summary(self) -> dict[str, Any]:
        """JSON-ready figures: per table rows and bytes per run and bytes per step, and the totals."""
        runs, steps = max(self.runs, 1), max(self.steps, 1)
        tables = {
            name: None
            if v is None
            else {
                "rows_per_run": round(v[0] / runs, 1),
                "bytes_per_run": round(v[1] / runs),
                "bytes_per_step": round(v[1] / steps, 1),
            }
            for name, v in self.tables.items()
        }
        return {
            "system": self.system,
            "steps_per_run": self.length,
            "runs": self.runs,
            "tables": tables,
            "total_bytes_per_run": round(self.total_bytes / runs),
            "total_bytes_per_step": round(self.total_bytes / steps, 1),
            "total_bytes_per_step_newest_history": round(self.total_newest_bytes / steps, 1),
        }


def session_pattern(length: int, tag: str) -> str:
    """The regular expression of the session ids of the measured runs of ``length`` of the system tagged ``tag``.

    Rounds name their runs ``<length>r<round><tag>-<i>`` (``bench.run``), so warm-up and WAL runs do not match.
    """
    return f"^{length}r[0-9]+{re.escape(tag)}-"


def stored(db: psycopg.Connection[Any], system: str, tag: str, length: int) -> Stored:
    """Rows and bytes (sum of ``pg_column_size`` of each whole row) of the measured runs of ``length``, per table."""
    pattern = session_pattern(length, tag)
    runs = _one(db, "SELECT count(*) FROM runs WHERE session_id ~ %s", (pattern,))
    tables: dict[str, tuple[int, int] | None] = {}
    for table in TABLES:
        if not _one(db, "SELECT count(*) FROM pg_class WHERE oid = to_regclass(%s)", (table,)):
            tables[table] = None
            continue
        row = db.execute(
            sql.SQL(
                "SELECT count(*), coalesce(sum(pg_column_size(t.*)), 0)::bigint FROM {} t WHERE t.session_id ~ %s"
            ).format(sql.Identifier(table)),
            (pattern,),
        ).fetchone()
        tables[table] = (int(row[0]), int(row[1])) if row else (0, 0)
    newest = _one(
        db,
        "SELECT coalesce(sum(pg_column_size(h.*)), 0)::bigint FROM checkpoint_history h"
        " JOIN (SELECT session_id, max(seq) AS top FROM checkpoint_history WHERE session_id ~ %s"
        " GROUP BY session_id) m USING (session_id) WHERE h.seq > m.top - %s",
        (pattern, PRODUCTION_HISTORY),
    )
    return Stored(system, length, runs, tables, newest)


def _one(db: psycopg.Connection[Any], query: str, params: tuple[Any, ...]) -> int:
    row = db.execute(query, params).fetchone()
    return int(row[0]) if row and row[0] is not None else 0


@dataclass(frozen=True)
class Sample:
    """The server's WAL position (bytes) and the run's seq, read in one statement at ``t``."""

    t: float
    lsn: int
    seq: int


@dataclass
class WalRun:
    """One run alone, sampled: its WAL positions with its seq, and the server's WAL rate just before it."""

    system: str
    length: int
    background_bytes_per_s: float
    samples: list[Sample] = field(repr=False)

    def windows(self) -> Windows:
        """WAL bytes per step of the first tenth, the last tenth and the whole of the run (``wal_windows``)."""
        return wal_windows(self.samples, self.length, self.background_bytes_per_s)

    def summary(self) -> dict[str, Any]:
        """JSON-ready figures (the samples left out)."""
        return {
            "system": self.system,
            "steps_per_run": self.length,
            "background_bytes_per_s": round(self.background_bytes_per_s),
            "samples": len(self.samples),
            "windows": self.windows(),
        }


def wal_windows(samples: list[Sample], length: int, background_bytes_per_s: float) -> Windows:
    """WAL bytes per step between seq 0 and ``length // 10`` (first tenth), the last tenth, and the whole run.

    A window goes from the last sample at or below its first seq to the first sample at or above its last
    seq, and divides the WAL written in between by the steps saved in between (the samples' seq difference),
    so polling late or early only moves the window by the steps it saw. ``background`` is the WAL the rest of
    the server would have written in the same time at ``background_bytes_per_s``, per step: included in the
    figure, since the WAL position is the server's. None for a window without a step in it.
    """
    tenth = max(1, length // 10)
    bounds = {"first_tenth": (0, tenth), "last_tenth": (length - tenth, length), "whole_run": (0, length)}
    found: Windows = {}
    for name, (low, high) in bounds.items():
        before = [s for s in samples if s.seq <= low]
        after = [s for s in samples if s.seq >= high]
        if not samples:
            found[name] = None
            continue
        start = before[-1] if before else samples[0]
        end = after[0] if after else samples[-1]
        steps = end.seq - start.seq
        if steps <= 0:
            found[name] = None
            continue
        seconds = end.t - start.t
        found[name] = {
            "from_seq": start.seq,
            "to_seq": end.seq,
            "wal_bytes": end.lsn - start.lsn,
            "bytes_per_step": round((end.lsn - start.lsn) / steps, 1),
            "background_bytes_per_step": round(background_bytes_per_s * seconds / steps, 1),
            "ms_per_step": round(seconds * 1000 / steps, 3),
        }
    return found


_SAMPLE = (
    "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint, r.seq, r.status,"
    " r.last_error IS NOT NULL AND NOT (r.last_error->>'retryable')::boolean"
    " FROM (SELECT 1) one LEFT JOIN runs r ON r.session_id = %s"
)


def _wal_position(db: psycopg.Connection[Any]) -> int:
    return _one(db, "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint", ())


def wal_run(
    db: psycopg.Connection[Any],
    handle: Any,
    session_id: str,
    length: int,
    result_bytes: int,
    timeout_s: float,
    check: Callable[[], None],
    system: str = "lousho",
) -> WalRun:
    """Send one run of ``length`` steps through ``handle`` alone and sample the WAL and its seq until it finished.

    First reads the server's WAL rate for ``BACKGROUND_S`` with nothing of the bench running, then polls every
    ``POLL_S``. BenchError when the run is parked, a worker died (``check``) or it takes over ``timeout_s``.
    """
    before, started = _wal_position(db), time.monotonic()
    time.sleep(BACKGROUND_S)
    background = (_wal_position(db) - before) / (time.monotonic() - started)
    handle.send(bench_agents.input_for(length, result_bytes), session_id=session_id, check_agent=False)
    deadline = time.monotonic() + timeout_s
    samples: list[Sample] = []
    while True:
        row = db.execute(_SAMPLE, (session_id,)).fetchone()
        assert row is not None
        samples.append(Sample(time.monotonic(), int(row[0]), int(row[1] or 0)))
        if row[3]:
            raise BenchError(f"the WAL run {session_id} of {system} was parked with an error")
        if row[2] == "finished" and samples[-1].seq >= length:
            return WalRun(system, length, background, samples)
        if time.monotonic() > deadline:
            raise BenchError(f"the WAL run {session_id} of {system}: seq {samples[-1].seq}/{length} in {timeout_s} s")
        check()
        time.sleep(POLL_S)


def print_stored(found: list[Stored], history_limit: int) -> None:
    """The storage table of one system: one row per run length, bytes per step per table and the totals."""
    if not found:
        return
    print(
        f"\n{found[0].system} storage: bytes of the rows its measured runs left (sum of pg_column_size of each "
        f"row), per step; history limit {history_limit} (the bench keeps every history row)"
    )
    names = list(TABLES)
    print(
        "| steps per run | runs | "
        + " | ".join(f"{name} B/step" for name in names)
        + " | total B/run | total B/step | total B/step, newest "
        f"{PRODUCTION_HISTORY} history rows |"
    )
    print("|---:|---:|" + "---:|" * (len(names) + 3))
    for entry in found:
        figures = entry.summary()
        cells = []
        for name in names:
            table = figures["tables"][name]
            cells.append(
                "absent" if table is None else f"{table['bytes_per_step']:,.0f} ({table['rows_per_run']:g} rows/run)"
            )
        print(
            f"| {entry.length} | {entry.runs} | "
            + " | ".join(cells)
            + f" | {figures['total_bytes_per_run']:,} | {figures['total_bytes_per_step']:,.0f} "
            f"| {figures['total_bytes_per_step_newest_history']:,.0f} |"
        )


def print_wal(run: WalRun, result_bytes: int, history_limit: int) -> None:
    """The WAL table of one run alone: bytes per step in its first and last tenth and over the whole run."""
    windows = run.windows()
    print(
        f"\n{run.system} WAL per step: one run of {run.length} steps alone, tool results of {result_bytes} "
        f"bytes, history limit {history_limit}; {len(run.samples)} samples of pg_current_wal_lsn() and the "
        f"run's seq; server WAL before the run: {run.background_bytes_per_s:,.0f} B/s"
    )
    print("| part of the run | seq | WAL B/step | of which background (est.) B/step | ms per step |")
    print("|---|---:|---:|---:|---:|")
    for name, label in (("first_tenth", "first tenth"), ("last_tenth", "last tenth"), ("whole_run", "whole run")):
        window = windows[name]
        if window is None:
            print(f"| {label} | - | - | - | - |")
            continue
        print(
            f"| {label} | {window['from_seq']:.0f}-{window['to_seq']:.0f} | {window['bytes_per_step']:,.0f} "
            f"| {window['background_bytes_per_step']:,.0f} | {window['ms_per_step']:.2f} |"
        )
    first, last = windows["first_tenth"], windows["last_tenth"]
    if first and last and first["bytes_per_step"] > 0:
        print(
            f"last tenth / first tenth: {last['bytes_per_step'] / first['bytes_per_step']:.2f}x "
            "(1.00x: WAL per step independent of how far the run is)"
        )


def summaries(found: list[Stored], wal: list[WalRun]) -> dict[str, Any]:
    """Everything ``--storage`` measured, JSON-ready."""
    return {
        "stored": [entry.summary() for entry in found],
        "wal": [run.summary() for run in wal],
        "tables": list(TABLES),
        "production_history_limit": PRODUCTION_HISTORY,
    }
