"""One benchmark invocation: Lousho steps/s and per-step overhead against a bare Celery chain, side by side.

``Bench`` owns the services, the workers and the interleaved rounds; ``main`` is ``python -m bench``. What it
measures and how steps are timed: ``bench/README.md``. Figures are computed and printed by ``bench.report``.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg
import redis

from bench import agents as bench_agents
from bench import timing
from bench.config import ROOT, Config, parse_args
from bench.report import HEADER, aggregate, format_row, report, write_json
from bench.results import RoundResult, gaps_ms, read_lines, task_times
from bench.workers import BenchError, System, Worker, cpu_seconds

__all__ = ["Bench", "Config", "main", "parse_args"]

LOUSHO_QUEUE = "bench-lousho"
BARE_QUEUE = "bench-bare"
OTHER_QUEUE = "bench-other"
ADVANCE = "lousho.advance"


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
        """The file where ``system``'s worker writes its task timings."""
        return self.workdir / f"{system.name}-timings.tsv"

    # services

    def settings(self, queue: str = LOUSHO_QUEUE) -> Any:
        """Lousho settings pointing at the bench database and Redis db, sending to ``queue``."""
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
        """The environment of ``system``'s worker: ours without any ``LOUSHO_`` variable, plus the bench's."""
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
        """Start one worker subprocess per system, each logging to the work dir."""
        for system in self.systems:
            self.workers[system.name] = Worker(
                system.name, system.app, system.queue, self.config.concurrency, self.environment(system),
                self.workdir / f"{system.name}-worker.log", self.config.loglevel, cwd=system.root)

    def stop_workers(self) -> None:
        """Stop every worker started (warm shutdown, then a kill if it lingers)."""
        for worker in self.workers.values():
            worker.stop()

    def close(self) -> None:
        """Close the clients, the bare Celery app and the database connection this invocation opened."""
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
        """The ``producer.Client`` sending to ``system``'s queue (made on first use)."""
        if system.name not in self._clients:
            from producer import Client

            self._clients[system.name] = Client(self.settings(system.queue))
        return self._clients[system.name]

    @property
    def bare_app(self) -> Any:
        """The Celery app that sends the bare chains (made on first use)."""
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
        tasks = task_times(read_lines(self.timings(system)), ADVANCE, prefix)
        task_ms = [(end - start) * 1000 for spans in tasks.values() for start, end, _ in spans]
        steps = sum(len(saves) for saves in history.values())
        wall = ended - started
        return RoundResult(system.name, number, steps, wall, steps / wall, step_ms, task_ms, gaps_ms(tasks))

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
            tasks = task_times(read_lines(self.timings(system)), HOP, prefix)
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
        return RoundResult(system.name, number, done, wall, done / wall, step_ms, task_ms, gaps_ms(tasks))

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
        """The measured rounds, each system once per round in rotating order; prints each round's row."""
        results = []
        for number in range(1, self.config.rounds + 1):
            shift = (number - 1) % len(self.systems)
            for system in self.systems[shift:] + self.systems[:shift]:
                result = self.run_round(system, f"r{number}", number, self.config.runs, self.config.hops)
                results.append(result)
                print(format_row(result.summary()), flush=True)
        return results


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
        print(HEADER, flush=True)
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
