"""Lousho steps/s and per-step overhead against a bare Celery chain, side by side, in one invocation.

What it does:

1. recreates its own database (``lousho_bench``, migrated) and flushes its own Redis db (13);
2. starts two real worker subprocesses with the same pool and concurrency: a Lousho worker
   (``celery -A worker``, ``LOUSHO_AGENTS=bench.agents``) and a bare Celery worker
   (``celery -A bench.bare``), each on its own queue of the same Redis broker;
3. warms them up, then runs ``--rounds`` interleaved rounds (the order rotates each round):
   - Lousho: ``--runs`` concurrent runs of ``--hops`` steps each (model turn, no-op tool batch,
     model turn, ..., final text), sent through ``producer.Client``;
   - bare: ``--runs`` concurrent chains of the same number of hops, each hop a task that only
     enqueues the next;
4. prints a table (steps/s, per-step p50/p99, in-task time, ratio Lousho/bare) and the workers'
   peak RSS, optionally writes it as JSON, and stops every subprocess it started.

``--other-tree PATH`` adds a third system, "other": a Lousho worker started from another copy of
the project (same schema), measured in the same rounds, to compare a change side by side.

How steps are timed (see ``bench/README.md``):

- steps/s = steps of the round / (end of the last step - time before the first send);
- per-step time = the gap between consecutive steps of one run: for Lousho the deltas of
  ``checkpoint_history.saved_at`` (the run's ``created_at`` before the first), for bare the deltas
  of the hop tasks' start times (the send time before the first). With more runs than worker
  processes this includes the wait in the queue behind other runs' steps;
- in-task time = the task body as seen by Celery's ``task_prerun``/``task_postrun`` signals
  (``bench.timing``), i.e. the step's own work without delivery and ack;
- gap = from the end of one task to the start of the next task of the same run: broker delivery,
  ack and (with more runs than pool processes) the wait in the queue;
- CPU per step = user + system time of the worker's processes and of the Postgres backends serving
  the bench database over the round (``/proc/<pid>/stat``), divided by its steps.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from itertools import pairwise
from pathlib import Path
from typing import Any

import psycopg
import redis

from bench import agents as bench_agents
from bench import timing

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
LOUSHO_QUEUE = "bench-lousho"
BARE_QUEUE = "bench-bare"
OTHER_QUEUE = "bench-other"
ADVANCE = "lousho.advance"


# -- configuration ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Config:
    """What one invocation measures, and against which services."""

    runs: int = 20
    hops: int = 21
    rounds: int = 5
    concurrency: int = 2
    warmup_hops: int = 5
    server_url: str = "postgresql://postgres@127.0.0.1:5432/postgres"
    database: str = "lousho_bench"
    redis_url: str = "redis://127.0.0.1:6379"
    redis_db: int = 13
    loglevel: str = "WARNING"
    timeout_s: float = 120.0
    json_path: str | None = None
    usage: bool = False
    other_tree: str | None = None

    @property
    def agent(self) -> str:
        """The bench agent the Lousho runs use."""
        return bench_agents.USAGE_AGENT if self.usage else bench_agents.AGENT

    @property
    def steps_per_run(self) -> int:
        """Steps one Lousho run really takes (an odd number; see ``bench.agents``)."""
        return bench_agents.steps_for(self.hops)

    @property
    def database_url(self) -> str:
        base, _, query = self.server_url.partition("?")
        base = base.rsplit("/", 1)[0] if base.count("/") >= 3 else base
        return f"{base}/{self.database}" + (f"?{query}" if query else "")

    @property
    def bench_redis_url(self) -> str:
        base, _, query = self.redis_url.partition("?")
        parts = base.rstrip("/").split("/")
        if len(parts) > 3 and parts[-1].isdigit():
            parts = parts[:-1]
        return "/".join(parts) + f"/{self.redis_db}" + (f"?{query}" if query else "")

    @property
    def history_limit(self) -> int:
        """Production default (50), raised when runs are longer so every step keeps its row."""
        return max(50, self.steps_per_run + 1)


def parse_args(argv: Sequence[str] | None) -> Config:
    """The command line as a ``Config``."""
    defaults = Config()
    parser = argparse.ArgumentParser(
        prog="python -m bench", description="Lousho steps/s and per-step overhead against a bare Celery chain.")
    parser.add_argument("--runs", type=int, default=defaults.runs, help="concurrent runs (and chains) per round")
    parser.add_argument("--hops", type=int, default=defaults.hops,
                        help="steps per run; rounded up to odd (tool turns come in pairs, plus the final turn)")
    parser.add_argument("--rounds", type=int, default=defaults.rounds, help="rounds of each system, interleaved")
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency,
                        help="prefork processes of each worker")
    parser.add_argument("--json", nargs="?", const="", default=None, metavar="PATH",
                        help="write the results as JSON (default path: bench/results/bench-<time>.json)")
    parser.add_argument("--server-url", default=os.environ.get("LOUSHO_BENCH_SERVER_URL", defaults.server_url),
                        help="Postgres server URL (the bench database is created next to it)")
    parser.add_argument("--database", default=defaults.database, help="database to drop and recreate")
    parser.add_argument("--redis-url", default=os.environ.get("LOUSHO_BENCH_REDIS_URL", defaults.redis_url))
    parser.add_argument("--redis-db", type=int, default=defaults.redis_db, help="Redis db to flush and use")
    parser.add_argument("--loglevel", default=defaults.loglevel, help="worker log level (both workers)")
    parser.add_argument("--timeout", type=float, default=defaults.timeout_s, help="seconds allowed per round")
    parser.add_argument("--usage", action="store_true",
                        help="the model reports token usage like a real provider (one more write per model turn)")
    parser.add_argument("--other-tree", metavar="PATH",
                        help="also measure a Lousho worker started from this copy of the project (same schema)")
    args = parser.parse_args(argv)
    for name in ("runs", "hops", "rounds", "concurrency"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.other_tree is not None:
        other = Path(args.other_tree).resolve()
        if not (other / "worker" / "celery.py").exists():
            parser.error(f"--other-tree {other} does not look like a copy of the project")
        args.other_tree = str(other)
    return Config(runs=args.runs, hops=args.hops, rounds=args.rounds, concurrency=args.concurrency,
                  server_url=args.server_url, database=args.database, redis_url=args.redis_url,
                  redis_db=args.redis_db, loglevel=args.loglevel, timeout_s=args.timeout, json_path=args.json,
                  usage=args.usage, other_tree=args.other_tree)


# -- statistics ------------------------------------------------------------------------------------

def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear between closest ranks; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class RoundResult:
    """One round of one system."""

    system: str
    round: int
    steps: int
    wall_s: float
    steps_per_s: float
    step_ms: list[float] = field(repr=False)
    task_ms: list[float] = field(repr=False)
    gap_ms: list[float] = field(repr=False, default_factory=list)
    worker_cpu_s: float = 0.0
    worker_main_cpu_s: float = 0.0
    postgres_cpu_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "system": self.system, "round": self.round, "steps": self.steps, "wall_s": round(self.wall_s, 4),
            "steps_per_s": round(self.steps_per_s, 2),
            "step_p50_ms": round(percentile(self.step_ms, 50), 3),
            "step_p99_ms": round(percentile(self.step_ms, 99), 3),
            "task_p50_ms": round(percentile(self.task_ms, 50), 3),
            "task_p99_ms": round(percentile(self.task_ms, 99), 3),
            "tasks_timed": len(self.task_ms),
            "gap_p50_ms": round(percentile(self.gap_ms, 50), 3),
            "worker_cpu_ms_per_step": round(self.worker_cpu_s * 1000 / self.steps, 3),
            "worker_main_cpu_ms_per_step": round(self.worker_main_cpu_s * 1000 / self.steps, 3),
            "postgres_cpu_ms_per_step": round(self.postgres_cpu_s * 1000 / self.steps, 3),
        }


Span = tuple[float, float, int | None]  # start, end, position in the run (seq or hop number)


def _task_times(lines: Iterator[list[str]], name: str, prefix: str) -> dict[str, list[Span]]:
    """(start, end, position) of each timed task of ``name`` whose first argument starts with ``prefix``."""
    found: dict[str, list[Span]] = defaultdict(list)
    for parts in lines:
        if len(parts) == 5 and parts[0] == name and parts[1].startswith(prefix):
            position = int(parts[2]) if parts[2].isdigit() else None
            found[parts[1]].append((float(parts[3]), float(parts[4]), position))
    return found


def _gaps_ms(tasks: dict[str, list[Span]]) -> list[float]:
    """Time from the end of one task to the start of the next task of the same run (delivery and ack)."""
    gaps = []
    for spans in tasks.values():
        ordered = sorted(spans)
        for (_, end, position), (start, _, following) in pairwise(ordered):
            # Only neighbours: a pool process's first task is not timed (the hook loads with the agents).
            if position is not None and following == position + 1:
                gaps.append((start - end) * 1000)
    return gaps


def _read_lines(path: Path) -> Iterator[list[str]]:
    if not path.exists():
        return iter(())
    return (line.split("\t") for line in path.read_text().splitlines())


# -- subprocesses ----------------------------------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of one process so far (0 when it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rfind(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / _TICK



class Worker:
    """A celery worker subprocess in its own process group, stopped with its children."""

    def __init__(self, label: str, app: str, queue: str, concurrency: int, env: dict[str, str], log: Path,
                 loglevel: str, cwd: Path = ROOT) -> None:
        self.label = label
        self.log = log
        command = [str(ROOT / ".venv" / "bin" / "celery"), "-A", app, "worker", "-P", "prefork",
                   "-c", str(concurrency), "--without-gossip", "--without-mingle", "--without-heartbeat",
                   "-Q", queue, "-n", f"{label}@%h", "-l", loglevel]
        if not Path(command[0]).exists():
            command[0:1] = [sys.executable, "-m", "celery"]
        self._log_file = log.open("wb")
        self.process = subprocess.Popen(command, cwd=cwd, env=env, stdout=self._log_file,
                                        stderr=subprocess.STDOUT, start_new_session=True)

    def alive(self) -> bool:
        return self.process.poll() is None

    def children(self) -> list[int]:
        """Pids of the pool processes (direct children of the main worker process)."""
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            if len(fields) > 1 and fields[1] == str(self.process.pid):
                found.append(int(entry.name))
        return sorted(found)

    def peak_rss_kib(self) -> dict[str, int]:
        """VmHWM (peak resident set) of the main process and each pool process, in KiB."""
        peaks = {}
        for role, pid in [("main", self.process.pid)] + [(f"child {pid}", pid) for pid in self.children()]:
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        peaks[role] = int(line.split()[1])
            except OSError:
                continue
        return peaks

    def cpu(self) -> dict[int, float]:
        """CPU seconds used so far by the main process and each pool process, by pid."""
        return {pid: cpu_seconds(pid) for pid in [self.process.pid, *self.children()]}

    def stop(self, grace_s: float = 10.0) -> None:
        """Warm shutdown of the whole process group, then a kill if it lingers."""
        if self.alive():
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # pool processes left behind, if any
        except (ProcessLookupError, PermissionError):
            pass
        if self.process.poll() is None:
            self.process.wait(5)
        self._log_file.close()

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class BenchError(RuntimeError):
    """The benchmark could not complete (a worker died, a round timed out, a run failed)."""


# -- the benchmark ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class System:
    """One thing measured: a Lousho worker (of this tree or another one) or the bare chain."""

    name: str
    kind: str  # "lousho" or "bare"
    queue: str
    root: Path
    tag: str  # makes its run ids unique within a round

    @property
    def app(self) -> str:
        return "worker" if self.kind == "lousho" else "bench.bare"


class Bench:
    """Owns the services, the workers and the rounds of one invocation."""

    def __init__(self, config: Config, workdir: Path) -> None:
        self.config = config
        self.workdir = workdir
        self.systems = [System("lousho", "lousho", LOUSHO_QUEUE, ROOT, "")]
        if config.other_tree is not None:
            self.systems.append(System("other", "lousho", OTHER_QUEUE, Path(config.other_tree), "o"))
        self.systems.append(System("bare", "bare", BARE_QUEUE, ROOT, "b"))
        self.workers: dict[str, Worker] = {}
        self._clients: dict[str, Any] = {}
        self._bare_app: Any = None
        self._db: psycopg.Connection[Any] | None = None

    def timings(self, system: System) -> Path:
        return self.workdir / f"{system.name}-timings.tsv"

    # services

    def settings(self, queue: str = LOUSHO_QUEUE) -> Any:
        from store.settings import Settings

        return Settings(database_url=self.config.database_url, redis_url=self.config.bench_redis_url,
                        history_limit=self.config.history_limit, queue=queue, agents="bench.agents")

    def prepare_services(self) -> None:
        """Drop and recreate the bench database, migrate it, flush the bench Redis db."""
        from store.database import migrate

        admin = self.config.server_url.replace("postgresql+psycopg://", "postgresql://")
        with psycopg.connect(admin, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.config.database}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{self.config.database}"')
        migrate(self.settings())
        redis.Redis.from_url(self.config.bench_redis_url, socket_connect_timeout=5).flushdb()
        self._db = psycopg.connect(self.config.database_url, autocommit=True)

    def environment(self, system: System) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LOUSHO_")}
        # The system's own tree first; this tree after it for ``bench`` when the other one has none.
        paths = dict.fromkeys([str(system.root), str(ROOT), env.get("PYTHONPATH", "")])
        env.update({
            "LOUSHO_DATABASE_URL": self.config.database_url,
            "LOUSHO_REDIS_URL": self.config.bench_redis_url,
            "LOUSHO_AGENTS": "bench.agents",
            "LOUSHO_QUEUE": system.queue,
            "LOUSHO_HISTORY_LIMIT": str(self.config.history_limit),
            timing.ENV: str(self.timings(system)),
            "PYTHONPATH": os.pathsep.join(p for p in paths if p),
        })
        return env

    def start_workers(self) -> None:
        for system in self.systems:
            self.workers[system.name] = Worker(
                system.name, system.app, system.queue, self.config.concurrency, self.environment(system),
                self.workdir / f"{system.name}-worker.log", self.config.loglevel, cwd=system.root)

    def stop_workers(self) -> None:
        for worker in self.workers.values():
            worker.stop()

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        if self._bare_app is not None:
            self._bare_app.close()
        if self._db is not None:
            self._db.close()

    def _check_workers(self) -> None:
        for worker in self.workers.values():
            if not worker.alive():
                raise BenchError(f"the {worker.label} worker exited ({worker.process.returncode}):\n{worker.tail()}")

    def client(self, system: System) -> Any:
        if system.name not in self._clients:
            from producer import Client

            self._clients[system.name] = Client(self.settings(system.queue))
        return self._clients[system.name]

    @property
    def bare_app(self) -> Any:
        if self._bare_app is None:
            from bench.bare import make_app

            self._bare_app = make_app(self.settings(BARE_QUEUE))
        return self._bare_app

    # rounds

    def run_round(self, system: System, label: str, number: int, runs: int, hops: int) -> RoundResult:
        """One round of ``system`` with its CPU use measured around it."""
        worker = self.workers[system.name]
        cpu_before, pg_before = worker.cpu(), self.postgres_cpu()
        prefix = f"{label}{system.tag}-"
        if system.kind == "lousho":
            result = self.lousho_round(system, prefix, number, runs, hops)
        else:
            result = self.bare_round(system, prefix, number, runs, bench_agents.steps_for(hops))
        cpu_after, pg_after = worker.cpu(), self.postgres_cpu()
        result.worker_cpu_s = sum(v - cpu_before.get(pid, 0.0) for pid, v in cpu_after.items())
        main_pid = worker.process.pid
        result.worker_main_cpu_s = cpu_after.get(main_pid, 0.0) - cpu_before.get(main_pid, 0.0)
        if system.kind == "lousho":
            result.postgres_cpu_s = sum(v - pg_before.get(pid, 0.0) for pid, v in pg_after.items())
        return result

    def lousho_round(self, system: System, prefix: str, number: int, runs: int, hops: int) -> RoundResult:
        """``runs`` concurrent Lousho runs of ``hops`` steps; timed from ``checkpoint_history``."""
        assert self._db is not None
        handle = self.client(system).agent(self.config.agent)
        message = bench_agents.input_for(hops)
        expected = bench_agents.steps_for(hops)
        started = time.time()
        for i in range(runs):
            handle.send(message, session_id=f"{prefix}{i:03d}", check_agent=False)
        deadline = time.monotonic() + self.config.timeout_s
        while True:
            row = self._db.execute(
                "SELECT count(*) FILTER (WHERE status = 'finished'),"
                " count(*) FILTER (WHERE last_error IS NOT NULL AND NOT (last_error->>'retryable')::boolean)"
                " FROM runs WHERE session_id LIKE %s", (prefix + "%",)).fetchone()
            finished, parked = (int(row[0]), int(row[1])) if row else (0, 0)
            if parked:
                raise BenchError(f"{parked} run(s) {prefix}* of {system.name} were parked with an error")
            if finished >= runs:
                break
            if time.monotonic() > deadline:
                raise BenchError(f"{system.name} runs {prefix}*: {finished}/{runs} finished in "
                                 f"{self.config.timeout_s} s")
            self._check_workers()
            time.sleep(0.05)
        history: dict[str, list[float]] = defaultdict(list)
        rows = self._db.execute(
            "SELECT r.session_id, extract(epoch FROM r.created_at)::float8, extract(epoch FROM h.saved_at)::float8"
            " FROM runs r JOIN checkpoint_history h USING (session_id)"
            " WHERE r.session_id LIKE %s ORDER BY r.session_id, h.seq", (prefix + "%",)).fetchall()
        created: dict[str, float] = {}
        for session_id, created_at, saved_at in rows:
            created[session_id] = float(created_at)
            history[session_id].append(float(saved_at))
        short = [sid for sid, saves in history.items() if len(saves) != expected]
        if len(history) != runs or short:
            raise BenchError(f"{system.name} runs {prefix}*: expected {runs} runs of {expected} saves, "
                             f"got {len(history)} runs, {len(short)} with another count")
        step_ms = []
        for session_id, saves in history.items():
            previous = created[session_id]
            for saved in saves:
                step_ms.append((saved - previous) * 1000)
                previous = saved
        ended = max(saves[-1] for saves in history.values())
        tasks = _task_times(_read_lines(self.timings(system)), ADVANCE, prefix)
        task_ms = [(end - start) * 1000 for spans in tasks.values() for start, end, _ in spans]
        steps = sum(len(saves) for saves in history.values())
        wall = ended - started
        return RoundResult(system.name, number, steps, wall, steps / wall, step_ms, task_ms, _gaps_ms(tasks))

    def bare_round(self, system: System, prefix: str, number: int, runs: int, hops: int) -> RoundResult:
        """``runs`` concurrent bare chains of ``hops`` hops; timed from the hop tasks' start times."""
        from bench.bare import HOP

        sent: dict[str, float] = {}
        started = time.time()
        for i in range(runs):
            chain = f"{prefix}{i:03d}"
            sent[chain] = time.time()
            self.bare_app.send_task(HOP, args=(chain, 1, hops), queue=system.queue)
        deadline = time.monotonic() + self.config.timeout_s
        while True:
            tasks = _task_times(_read_lines(self.timings(system)), HOP, prefix)
            done = sum(len(spans) for spans in tasks.values())
            if done >= runs * hops:
                break
            if time.monotonic() > deadline:
                raise BenchError(f"bare chains {prefix}*: {done}/{runs * hops} hops in {self.config.timeout_s} s")
            self._check_workers()
            time.sleep(0.05)
        step_ms = []
        for chain, spans in tasks.items():
            previous = sent[chain]
            for start, _, _ in sorted(spans):
                step_ms.append((start - previous) * 1000)
                previous = start
        task_ms = [(end - start) * 1000 for spans in tasks.values() for start, end, _ in spans]
        ended = max(end for spans in tasks.values() for _, end, _ in spans)
        wall = ended - started
        return RoundResult(system.name, number, done, wall, done / wall, step_ms, task_ms, _gaps_ms(tasks))

    def warm_up(self) -> None:
        """Start every worker's pool processes (imports, connections, first-task costs), unmeasured."""
        runs = max(2 * self.config.concurrency, 4)
        for system in self.systems:
            self.run_round(system, "warm", 0, runs, self.config.warmup_hops)

    def postgres_cpu(self) -> dict[int, float]:
        """CPU seconds used so far by the server processes serving the bench database (not ours)."""
        assert self._db is not None
        rows = self._db.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
                                (self.config.database,)).fetchall()
        return {int(pid): cpu_seconds(int(pid)) for (pid,) in rows}

    def measure(self) -> list[RoundResult]:
        results = []
        for number in range(1, self.config.rounds + 1):
            shift = (number - 1) % len(self.systems)
            for system in self.systems[shift:] + self.systems[:shift]:
                result = self.run_round(system, f"r{number}", number, self.config.runs, self.config.hops)
                results.append(result)
                print(_row(result.summary()), flush=True)
        return results


# -- reporting -------------------------------------------------------------------------------------

_HEADER = (f"{'round':>5}  {'system':<7} {'steps':>6} {'wall s':>7} {'steps/s':>8} "
           f"{'step p50':>9} {'step p99':>9} {'task p50':>9} {'task p99':>9} {'gap p50':>8} "
           f"{'wrk cpu':>8} {'pg cpu':>7}")


def _row(s: dict[str, Any]) -> str:
    return (f"{s['round']!s:>5}  {s['system']:<7} {s['steps']:>6} {s['wall_s']:>7.3f} {s['steps_per_s']:>8.1f} "
            f"{s['step_p50_ms']:>9.2f} {s['step_p99_ms']:>9.2f} {s['task_p50_ms']:>9.2f} {s['task_p99_ms']:>9.2f} "
            f"{s['gap_p50_ms']:>8.2f} {s['worker_cpu_ms_per_step']:>8.2f} {s['postgres_cpu_ms_per_step']:>7.2f}")


def aggregate(results: list[RoundResult]) -> dict[str, Any]:
    """Per system: median steps/s over rounds, percentiles over every step of every round; the ratios."""
    summary: dict[str, Any] = {}
    systems = list(dict.fromkeys(r.system for r in results))
    for system in systems:
        mine = [r for r in results if r.system == system]
        rates = [r.steps_per_s for r in mine]
        steps = [x for r in mine for x in r.step_ms]
        tasks = [x for r in mine for x in r.task_ms]
        gaps = [x for r in mine for x in r.gap_ms]
        count = sum(r.steps for r in mine)
        summary[system] = {
            "system": system, "round": "all", "steps": count, "wall_s": round(sum(r.wall_s for r in mine), 4),
            "steps_per_s": round(statistics.median(rates), 2),
            "steps_per_s_min": round(min(rates), 2), "steps_per_s_max": round(max(rates), 2),
            "step_p50_ms": round(percentile(steps, 50), 3), "step_p99_ms": round(percentile(steps, 99), 3),
            "task_p50_ms": round(percentile(tasks, 50), 3), "task_p99_ms": round(percentile(tasks, 99), 3),
            "gap_p50_ms": round(percentile(gaps, 50), 3),
            "worker_cpu_ms_per_step": round(sum(r.worker_cpu_s for r in mine) * 1000 / count, 3),
            "worker_main_cpu_ms_per_step": round(sum(r.worker_main_cpu_s for r in mine) * 1000 / count, 3),
            "postgres_cpu_ms_per_step": round(sum(r.postgres_cpu_s for r in mine) * 1000 / count, 3),
        }
        summary[system]["cpu_ms_per_step"] = round(
            summary[system]["worker_cpu_ms_per_step"] + summary[system]["postgres_cpu_ms_per_step"], 3)
    rounds: dict[int, dict[str, float]] = defaultdict(dict)
    for r in results:
        rounds[r.round][r.system] = r.steps_per_s
    summary["ratios"] = {}
    for system, base in [(s, "bare") for s in systems if s != "bare"] + [("other", "lousho")]:
        if system not in summary or base not in summary:
            continue
        paired = [p[system] / p[base] for p in rounds.values() if system in p and base in p]
        summary["ratios"][f"{system}/{base}"] = {
            "steps_per_s": round(summary[system]["steps_per_s"] / summary[base]["steps_per_s"], 3),
            "paired_median": round(statistics.median(paired), 3),
            "per_round": [round(x, 3) for x in paired],
            "cpu": round(summary[base]["cpu_ms_per_step"] / summary[system]["cpu_ms_per_step"], 3),
            "added_wall_ms_per_step": round(
                1000 / summary[system]["steps_per_s"] - 1000 / summary[base]["steps_per_s"], 3),
        }
    summary["ratio"] = summary["ratios"]["lousho/bare"]["steps_per_s"]
    return summary


def report(config: Config, summary: dict[str, Any], rss: dict[str, dict[str, int]]) -> None:
    systems = [name for name in ("lousho", "other", "bare") if name in summary]
    print()
    print(f"summary: {config.runs} concurrent runs x {config.steps_per_run} steps, {config.rounds} round(s) each, "
          f"prefork -c {config.concurrency}, agent {config.agent}"
          + (f", other = {config.other_tree}" if config.other_tree else ""))
    print("  steps/s: median of rounds (range); percentiles over every step of every round (ms); cpu: ms per step")
    print(_HEADER)
    for system in systems:
        print(_row(summary[system]))
    print("  steps/s range over rounds: " + ", ".join(
        f"{s} {summary[s]['steps_per_s_min']:.1f}-{summary[s]['steps_per_s_max']:.1f}" for s in systems))
    for name, ratio in summary["ratios"].items():
        per_round = ", ".join(f"{x:.2f}" for x in ratio["per_round"])
        target = ""
        if name.endswith("/bare"):
            target = " (meets the 0.75x target)" if ratio["steps_per_s"] >= 0.75 else " (below the 0.75x target)"
        print(f"ratio {name} steps/s: {ratio['steps_per_s']:.3f}x{target}; paired by round: median "
              f"{ratio['paired_median']:.3f}x ({per_round}); CPU per step: {ratio['cpu']:.3f}x; "
              f"added wall time per step: {ratio['added_wall_ms_per_step']:.2f} ms")
    print("CPU per step, worker (of which its main process) + bench database backends; Redis not counted: " + ", ".join(
        f"{s} {summary[s]['worker_cpu_ms_per_step']:.2f} ({summary[s]['worker_main_cpu_ms_per_step']:.2f}) + "
        f"{summary[s]['postgres_cpu_ms_per_step']:.2f} ms" for s in systems))
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
    for label, peaks in rss.items():
        if peaks:
            parts = ", ".join(f"{role} {kib / 1024:.1f}" for role, kib in peaks.items())
            print(f"peak RSS (VmHWM, MiB) {label} worker: {parts}")


def write_json(config: Config, results: list[RoundResult], summary: dict[str, Any],
               rss: dict[str, dict[str, int]]) -> Path:
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = Path(config.json_path) if config.json_path else RESULTS / f"bench-{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "when": stamp, "config": asdict(config) | {"steps_per_run": config.steps_per_run},
        "rounds": [r.summary() for r in results], "summary": summary, "peak_rss_kib": rss,
        "host": {"cpus": os.cpu_count(), "loadavg": os.getloadavg()},
    }
    path.write_text(json.dumps(document, indent=2) + "\n")
    return path


# -- entry point -----------------------------------------------------------------------------------

def _terminate(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; 0 on success, 1 when it could not complete, 130 when interrupted."""
    config = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started with SIGINT ignored
    workdir = Path(tempfile.mkdtemp(prefix="lousho-bench-"))
    bench = Bench(config, workdir)
    keep = True
    try:
        print(f"preparing database {config.database} and Redis db {config.redis_db}", flush=True)
        bench.prepare_services()
        bench.start_workers()
        print(f"workers started ({', '.join(bench.workers)}; prefork -c {config.concurrency}); warming up",
              flush=True)
        bench.warm_up()
        print(_HEADER, flush=True)
        results = bench.measure()
        rss = {name: w.peak_rss_kib() for name, w in bench.workers.items()}
        summary = aggregate(results)
        report(config, summary, rss)
        if config.json_path is not None:
            print(f"results written to {write_json(config, results, summary, rss)}")
        keep = False
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted; stopping workers", file=sys.stderr)
        keep = False
        return 130
    except (BenchError, psycopg.Error, redis.RedisError, OSError) as exc:
        print(f"benchmark failed: {type(exc).__name__}: {exc}\nworker logs and timings kept in {workdir}",
              file=sys.stderr)
        return 1
    finally:
        # A second Ctrl-C or TERM must not cut the cleanup short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            bench.stop_workers()
            bench.close()
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
