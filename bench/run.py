"""Lousho steps/s and per-step overhead against a bare Celery chain, side by side, in one invocation.

What it does:

1. recreates its own database (``lousho_bench``, migrated) and flushes its own Redis db (13);
2. starts two real worker subprocesses with the same pool and concurrency: a Lousho worker
   (``celery -A worker``, ``LOUSHO_AGENTS=bench.agents``) and a bare Celery worker
   (``celery -A bench.bare``), each on its own queue of the same Redis broker;
3. warms both up, then runs ``--rounds`` interleaved rounds (the order alternates each round):
   - Lousho: ``--runs`` concurrent runs of ``--hops`` steps each (model turn, no-op tool batch,
     model turn, ..., final text), sent through ``producer.Client``;
   - bare: ``--runs`` concurrent chains of the same number of hops, each hop a task that only
     enqueues the next;
4. prints a table (steps/s, per-step p50/p99, in-task time, ratio Lousho/bare) and the workers'
   peak RSS, optionally writes it as JSON, and stops every subprocess it started.

How steps are timed (see ``bench/README.md``):

- steps/s = steps of the round / (end of the last step - time before the first send);
- per-step time = the gap between consecutive steps of one run: for Lousho the deltas of
  ``checkpoint_history.saved_at`` (the run's ``created_at`` before the first), for bare the deltas
  of the hop tasks' start times (the send time before the first). With more runs than worker
  processes this includes the wait in the queue behind other runs' steps;
- in-task time = the task body as seen by Celery's ``task_prerun``/``task_postrun`` signals
  (``bench.timing``), i.e. the step's own work without delivery and ack.
"""

from __future__ import annotations

import argparse
import json
import os
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
ADVANCE = "lousho.advance"


# -- configuration ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Config:
    """What one invocation measures, and against which services."""

    runs: int = 20
    hops: int = 21
    rounds: int = 3
    concurrency: int = 2
    warmup_hops: int = 5
    server_url: str = "postgresql://postgres@127.0.0.1:5432/postgres"
    database: str = "lousho_bench"
    redis_url: str = "redis://127.0.0.1:6379"
    redis_db: int = 13
    loglevel: str = "WARNING"
    timeout_s: float = 120.0
    json_path: str | None = None

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
    args = parser.parse_args(argv)
    for name in ("runs", "hops", "rounds", "concurrency"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    return Config(runs=args.runs, hops=args.hops, rounds=args.rounds, concurrency=args.concurrency,
                  server_url=args.server_url, database=args.database, redis_url=args.redis_url,
                  redis_db=args.redis_db, loglevel=args.loglevel, timeout_s=args.timeout, json_path=args.json)


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

    def summary(self) -> dict[str, Any]:
        return {
            "system": self.system, "round": self.round, "steps": self.steps, "wall_s": round(self.wall_s, 4),
            "steps_per_s": round(self.steps_per_s, 2),
            "step_p50_ms": round(percentile(self.step_ms, 50), 3),
            "step_p99_ms": round(percentile(self.step_ms, 99), 3),
            "task_p50_ms": round(percentile(self.task_ms, 50), 3),
            "task_p99_ms": round(percentile(self.task_ms, 99), 3),
            "tasks_timed": len(self.task_ms),
        }


def _task_times(lines: Iterator[list[str]], name: str, prefix: str) -> dict[str, list[tuple[float, float]]]:
    """(start, end) of each timed task of ``name`` whose first argument starts with ``prefix``."""
    found: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for parts in lines:
        if len(parts) == 5 and parts[0] == name and parts[1].startswith(prefix):
            found[parts[1]].append((float(parts[3]), float(parts[4])))
    return found


def _read_lines(path: Path) -> Iterator[list[str]]:
    if not path.exists():
        return iter(())
    return (line.split("\t") for line in path.read_text().splitlines())


# -- subprocesses ----------------------------------------------------------------------------------

class Worker:
    """A celery worker subprocess in its own process group, stopped with its children."""

    def __init__(self, label: str, app: str, queue: str, concurrency: int, env: dict[str, str], log: Path,
                 loglevel: str) -> None:
        self.label = label
        self.log = log
        command = [str(ROOT / ".venv" / "bin" / "celery"), "-A", app, "worker", "-P", "prefork",
                   "-c", str(concurrency), "--without-gossip", "--without-mingle", "--without-heartbeat",
                   "-Q", queue, "-n", f"{label}@%h", "-l", loglevel]
        if not Path(command[0]).exists():
            command[0:1] = [sys.executable, "-m", "celery"]
        self._log_file = log.open("wb")
        self.process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=self._log_file,
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

class Bench:
    """Owns the services, the workers and the rounds of one invocation."""

    def __init__(self, config: Config, workdir: Path) -> None:
        self.config = config
        self.workdir = workdir
        self.lousho_timings = workdir / "lousho-timings.tsv"
        self.bare_timings = workdir / "bare-timings.tsv"
        self.workers: list[Worker] = []
        self._client: Any = None
        self._bare_app: Any = None
        self._db: psycopg.Connection[Any] | None = None

    # services

    def settings(self) -> Any:
        from store.settings import Settings

        return Settings(database_url=self.config.database_url, redis_url=self.config.bench_redis_url,
                        history_limit=self.config.history_limit, queue=LOUSHO_QUEUE, agents="bench.agents")

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

    def environment(self, timings: Path, queue: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LOUSHO_")}
        env.update({
            "LOUSHO_DATABASE_URL": self.config.database_url,
            "LOUSHO_REDIS_URL": self.config.bench_redis_url,
            "LOUSHO_AGENTS": "bench.agents",
            "LOUSHO_QUEUE": queue,
            "LOUSHO_HISTORY_LIMIT": str(self.config.history_limit),
            timing.ENV: str(timings),
            "PYTHONPATH": os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH", "")] if p),
        })
        return env

    def start_workers(self) -> None:
        c = self.config
        self.workers.append(Worker("lousho", "worker", LOUSHO_QUEUE, c.concurrency,
                                   self.environment(self.lousho_timings, LOUSHO_QUEUE),
                                   self.workdir / "lousho-worker.log", c.loglevel))
        self.workers.append(Worker("bare", "bench.bare", BARE_QUEUE, c.concurrency,
                                   self.environment(self.bare_timings, BARE_QUEUE),
                                   self.workdir / "bare-worker.log", c.loglevel))

    def stop_workers(self) -> None:
        for worker in self.workers:
            worker.stop()

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
        if self._bare_app is not None:
            self._bare_app.close()
        if self._db is not None:
            self._db.close()

    def _check_workers(self) -> None:
        for worker in self.workers:
            if not worker.alive():
                raise BenchError(f"the {worker.label} worker exited ({worker.process.returncode}):\n{worker.tail()}")

    @property
    def client(self) -> Any:
        if self._client is None:
            from producer import Client

            self._client = Client(self.settings())
        return self._client

    @property
    def bare_app(self) -> Any:
        if self._bare_app is None:
            from bench.bare import make_app

            self._bare_app = make_app(self.settings().model_copy(update={"queue": BARE_QUEUE}))
        return self._bare_app

    # rounds

    def lousho_round(self, label: str, number: int, runs: int, hops: int) -> RoundResult:
        """``runs`` concurrent Lousho runs of ``hops`` steps; timed from ``checkpoint_history``."""
        assert self._db is not None
        prefix = f"{label}-"
        handle = self.client.agent(bench_agents.AGENT)
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
                raise BenchError(f"{parked} Lousho run(s) of {label} were parked with an error")
            if finished >= runs:
                break
            if time.monotonic() > deadline:
                raise BenchError(f"Lousho round {label}: {finished}/{runs} runs finished in {self.config.timeout_s} s")
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
            raise BenchError(f"Lousho round {label}: expected {runs} runs of {expected} saves, "
                             f"got {len(history)} runs, {len(short)} with another count")
        step_ms = []
        for session_id, saves in history.items():
            previous = created[session_id]
            for saved in saves:
                step_ms.append((saved - previous) * 1000)
                previous = saved
        ended = max(saves[-1] for saves in history.values())
        tasks = _task_times(_read_lines(self.lousho_timings), ADVANCE, prefix)
        task_ms = [(end - start) * 1000 for spans in tasks.values() for start, end in spans]
        steps = sum(len(saves) for saves in history.values())
        wall = ended - started
        return RoundResult("lousho", number, steps, wall, steps / wall, step_ms, task_ms)

    def bare_round(self, label: str, number: int, runs: int, hops: int) -> RoundResult:
        """``runs`` concurrent bare chains of ``hops`` hops; timed from the hop tasks' start times."""
        from bench.bare import HOP

        prefix = f"{label}-"
        sent: dict[str, float] = {}
        started = time.time()
        for i in range(runs):
            chain = f"{prefix}{i:03d}"
            sent[chain] = time.time()
            self.bare_app.send_task(HOP, args=(chain, 1, hops), queue=BARE_QUEUE)
        deadline = time.monotonic() + self.config.timeout_s
        while True:
            tasks = _task_times(_read_lines(self.bare_timings), HOP, prefix)
            done = sum(len(spans) for spans in tasks.values())
            if done >= runs * hops:
                break
            if time.monotonic() > deadline:
                raise BenchError(f"bare round {label}: {done}/{runs * hops} hops in {self.config.timeout_s} s")
            self._check_workers()
            time.sleep(0.05)
        step_ms = []
        for chain, spans in tasks.items():
            previous = sent[chain]
            for start, _ in sorted(spans):
                step_ms.append((start - previous) * 1000)
                previous = start
        task_ms = [(end - start) * 1000 for spans in tasks.values() for start, end in spans]
        ended = max(end for spans in tasks.values() for _, end in spans)
        wall = ended - started
        return RoundResult("bare", number, done, wall, done / wall, step_ms, task_ms)

    def warm_up(self) -> None:
        """Start both workers' pool processes (imports, connections, first-task costs), unmeasured."""
        runs = max(2 * self.config.concurrency, 4)
        self.lousho_round("warm", 0, runs, self.config.warmup_hops)
        self.bare_round("warm", 0, runs, bench_agents.steps_for(self.config.warmup_hops))

    def measure(self) -> list[RoundResult]:
        results = []
        c = self.config
        for number in range(1, c.rounds + 1):
            order = ("lousho", "bare") if number % 2 else ("bare", "lousho")
            for system in order:
                if system == "lousho":
                    result = self.lousho_round(f"r{number}", number, c.runs, c.hops)
                else:
                    result = self.bare_round(f"r{number}", number, c.runs, c.steps_per_run)
                results.append(result)
                print(_row(result.summary()), flush=True)
        return results


# -- reporting -------------------------------------------------------------------------------------

_HEADER = (f"{'round':>5}  {'system':<7} {'steps':>6} {'wall s':>7} {'steps/s':>8} "
           f"{'step p50':>9} {'step p99':>9} {'task p50':>9} {'task p99':>9}")


def _row(s: dict[str, Any]) -> str:
    return (f"{s['round']!s:>5}  {s['system']:<7} {s['steps']:>6} {s['wall_s']:>7.3f} {s['steps_per_s']:>8.1f} "
            f"{s['step_p50_ms']:>9.2f} {s['step_p99_ms']:>9.2f} {s['task_p50_ms']:>9.2f} {s['task_p99_ms']:>9.2f}")


def aggregate(results: list[RoundResult]) -> dict[str, Any]:
    """Per system: median steps/s over rounds, percentiles over every step of every round; the ratio."""
    summary: dict[str, Any] = {}
    for system in ("lousho", "bare"):
        mine = [r for r in results if r.system == system]
        rates = [r.steps_per_s for r in mine]
        steps = [x for r in mine for x in r.step_ms]
        tasks = [x for r in mine for x in r.task_ms]
        summary[system] = {
            "system": system, "round": "all", "steps": sum(r.steps for r in mine),
            "wall_s": round(sum(r.wall_s for r in mine), 4),
            "steps_per_s": round(statistics.median(rates), 2),
            "steps_per_s_min": round(min(rates), 2), "steps_per_s_max": round(max(rates), 2),
            "step_p50_ms": round(percentile(steps, 50), 3), "step_p99_ms": round(percentile(steps, 99), 3),
            "task_p50_ms": round(percentile(tasks, 50), 3), "task_p99_ms": round(percentile(tasks, 99), 3),
        }
    pairs = defaultdict(dict)
    for r in results:
        pairs[r.round][r.system] = r.steps_per_s
    per_round = [p["lousho"] / p["bare"] for p in pairs.values() if "lousho" in p and "bare" in p]
    summary["ratio"] = round(summary["lousho"]["steps_per_s"] / summary["bare"]["steps_per_s"], 3)
    summary["ratio_per_round"] = [round(x, 3) for x in per_round]
    summary["overhead_per_step_ms"] = round(
        1000 / summary["lousho"]["steps_per_s"] - 1000 / summary["bare"]["steps_per_s"], 3)
    return summary


def report(config: Config, results: list[RoundResult], summary: dict[str, Any],
           rss: dict[str, dict[str, int]]) -> None:
    print()
    print(f"summary: {config.runs} concurrent runs x {config.steps_per_run} steps, {config.rounds} round(s) each, "
          f"prefork -c {config.concurrency}")
    print("  steps/s: median of rounds; step and task percentiles: over every step of every round (ms)")
    print(_HEADER)
    for system in ("lousho", "bare"):
        print(_row(summary[system]))
    print(f"  steps/s range over rounds: lousho {summary['lousho']['steps_per_s_min']:.1f}-"
          f"{summary['lousho']['steps_per_s_max']:.1f}, bare {summary['bare']['steps_per_s_min']:.1f}-"
          f"{summary['bare']['steps_per_s_max']:.1f}")
    per_round = ", ".join(f"{x:.2f}" for x in summary["ratio_per_round"])
    verdict = "meets" if summary["ratio"] >= 0.75 else "below"
    print(f"ratio lousho/bare steps/s: {summary['ratio']:.3f}x ({verdict} the 0.75x target; per round: {per_round})")
    print(f"added cost per step (1/rate difference, whole worker): {summary['overhead_per_step_ms']:.2f} ms")
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
    workdir = Path(tempfile.mkdtemp(prefix="lousho-bench-"))
    bench = Bench(config, workdir)
    keep = True
    try:
        print(f"preparing database {config.database} and Redis db {config.redis_db}", flush=True)
        bench.prepare_services()
        bench.start_workers()
        print(f"workers started (prefork -c {config.concurrency}); warming up", flush=True)
        bench.warm_up()
        print(_HEADER, flush=True)
        results = bench.measure()
        rss = {w.label: w.peak_rss_kib() for w in bench.workers}
        summary = aggregate(results)
        report(config, results, summary, rss)
        if config.json_path is not None:
            print(f"results written to {write_json(config, results, summary, rss)}")
        keep = False
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted; stopping workers", file=sys.stderr)
        return 130
    except BenchError as exc:
        print(f"benchmark failed: {exc}\nworker logs and timings kept in {workdir}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not skip the cleanup
        try:
            bench.stop_workers()
            bench.close()
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if not keep:
            for path in workdir.iterdir():
                path.unlink()
            workdir.rmdir()


if __name__ == "__main__":
    sys.exit(main())
