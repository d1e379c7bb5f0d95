"""One benchmark invocation: Lousho steps/s and per-step overhead against a bare Celery chain (and DBOS), side by side.

``Bench`` owns the services, the workers and the interleaved rounds of each run length; ``main`` is ``python -m
bench``. What it measures: ``bench/README.md``. Rounds are taken by ``bench.rounds`` (``bench.dbos_peer`` for DBOS),
figures computed and printed by ``bench.report``.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg
import redis

from bench import dbos_app, dbos_peer, floor, rounds, rss, storage, timing
from bench.config import CHAIN, ROOT, Config, parse_args
from bench.report import HEADER, aggregate, format_row, report, write_json
from bench.results import RoundResult
from bench.watch import Consumers
from bench.workers import BenchError, System, Worker, celery_command, cpu_seconds

__all__ = ["CHAIN", "Bench", "Config", "chain_system", "main", "parse_args"]

LOUSHO_QUEUE = "bench-lousho"
BARE_QUEUE = "bench-bare"
OTHER_QUEUE = "bench-other"
FLOOR_QUEUE = "bench-floor"

#: ``--events`` variants as systems: the one with events on keeps the Lousho worker's name, queue and tag.
EVENT_SYSTEMS = {
    "on": System("lousho", "lousho", LOUSHO_QUEUE, ROOT, "", (("LOUSHO_EVENTS", "1"),)),
    "off": System("ev-off", "lousho", "bench-lousho-off", ROOT, "e", (("LOUSHO_EVENTS", "0"),)),
    "watched": System("watched", "lousho", "bench-lousho-watched", ROOT, "w", (("LOUSHO_EVENTS", "1"),), True),
}


def chain_system(config: Config) -> System:
    """The ``lousho-chain`` worker of this tree, on its own queue, with the ``--continue-*`` settings."""
    env = (("LOUSHO_CONTINUE_STEPS", str(config.continue_steps)), ("LOUSHO_CONTINUE_MS", str(config.continue_ms)))
    return System(CHAIN, "lousho", "bench-lousho-chain", ROOT, "c", env)


class Bench:
    """Owns the services, the workers and the rounds of one invocation."""

    def __init__(self, config: Config, workdir: Path) -> None:
        self.config = config
        self.workdir = workdir
        self.systems = (
            [EVENT_SYSTEMS[variant] for variant in config.events]
            if config.events
            else [System("lousho", "lousho", LOUSHO_QUEUE, ROOT, "")]
        )
        if "on" in config.continuation:
            chained = chain_system(config)
            self.systems = [chained] if config.continuation == ("on",) else [chained, *self.systems]
        if config.other_tree is not None:
            self.systems.append(System("other", "lousho", OTHER_QUEUE, Path(config.other_tree), "o"))
        if not config.rss_steps:  # the RSS mode measures the Lousho worker alone
            self.systems.append(System("bare", "bare", BARE_QUEUE, ROOT, "b"))
            if config.floor:
                self.systems.append(System("floor", "bare", FLOOR_QUEUE, ROOT, "f", ((floor.ENV, "1"),)))
        self.peer: dbos_peer.DbosPeer | None = None
        if config.peer == "dbos" and dbos_peer.missing() is None:
            self.peer = dbos_peer.DbosPeer(config, workdir)
            self.systems.append(System("dbos", "dbos", dbos_app.QUEUE, ROOT, "d"))
        self.workers: dict[str, Worker] = {}
        self.peak_rss: dict[int, dict[str, int]] = {}  # run length -> system -> largest VmHWM so far (KiB)
        self._clients: dict[str, Any] = {}
        self._consumer_client: Any = None
        self._bare_app: Any = None
        self._db: psycopg.Connection[Any] | None = None

    def timings(self, system: System) -> Path:
        """The file where ``system``'s worker writes its task timings."""
        return self.workdir / f"{system.name}-timings.tsv"

    # services

    def settings(self, queue: str = LOUSHO_QUEUE) -> Any:
        """Lousho settings pointing at the bench database and Redis db, sending to ``queue``."""
        from store.settings import Settings

        return Settings(
            database_url=self.config.database_url,
            redis_url=self.config.bench_redis_url,
            history_limit=self.config.history_limit,
            queue=queue,
            agents="bench.agents",
        )

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
        if any(system.name == "floor" for system in self.systems):
            floor.prepare(self.config.database_url)
        if self.peer is not None:
            self.peer.prepare()

    def environment(self, system: System) -> dict[str, str]:
        """The environment of ``system``'s worker: ours without any ``LOUSHO_`` variable, plus the bench's."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("LOUSHO_")}
        # The system's own tree first; this tree after it for ``bench`` when the other one has none.
        paths = dict.fromkeys([str(system.root), str(ROOT), env.get("PYTHONPATH", "")])
        env.update(
            {
                "LOUSHO_DATABASE_URL": self.config.database_url,
                "LOUSHO_REDIS_URL": self.config.bench_redis_url,
                "LOUSHO_AGENTS": "bench.agents",
                "LOUSHO_QUEUE": system.queue,
                "LOUSHO_HISTORY_LIMIT": str(self.config.history_limit),
                "LOUSHO_TASK_EVENTS": "true" if self.config.task_events else "false",
                timing.ENV: str(self.timings(system)),
                "PYTHONPATH": os.pathsep.join(p for p in paths if p),
            }
        )
        env.update(system.env)
        return env

    def start_workers(self) -> None:
        """Start one worker subprocess per system, each logging to the work dir; wait for the DBOS peer's."""
        for system in self.systems:
            if system.kind == "dbos" and self.peer is not None:
                command = self.peer.command()
            else:
                command = celery_command(
                    system.name, system.app, system.queue, self.config.concurrency, self.config.loglevel
                )
            self.workers[system.name] = Worker(
                system.name,
                command,
                self.environment(system),
                self.workdir / f"{system.name}-worker.log",
                cwd=system.root,
            )
        if self.peer is not None:
            self.peer.connect(self.workers["dbos"].alive)
            self.workers["dbos"].pause()

    def stop_workers(self) -> None:
        """Stop every worker started (warm shutdown, then a kill if it lingers)."""
        for worker in self.workers.values():
            worker.stop()

    def close(self) -> None:
        """Close the clients, the bare Celery app and the database connection this invocation opened."""
        for client in self._clients.values():
            client.close()
        if self._consumer_client is not None:
            self._consumer_client.close()
            self._consumer_client.engine.dispose()
        if self._bare_app is not None:
            self._bare_app.close()
        if self.peer is not None:
            self.peer.close()
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
    def consumer_client(self) -> Any:
        """The ``producer.Client`` the consumers of watched runs read with (its own pool, one connection per run)."""
        if self._consumer_client is None:
            from producer import Client
            from store.database import make_engine

            settings = self.settings()
            self._consumer_client = Client(settings, engine=make_engine(settings, pool_size=self.config.runs))
        return self._consumer_client

    @property
    def bare_app(self) -> Any:
        """The Celery app that sends the bare chains (made on first use)."""
        if self._bare_app is None:
            from bench.bare import make_app

            self._bare_app = make_app(self.settings(BARE_QUEUE))
        return self._bare_app

    # rounds

    def database_of(self, system: System) -> str | None:
        """The database whose server processes work for ``system`` (their CPU is its Postgres CPU), if any."""
        if system.name == "floor":  # its table is in the bench database
            return self.config.database
        return {"lousho": self.config.database, "dbos": self.config.dbos_database}.get(system.kind)

    def run_round(self, system: System, label: str, number: int, runs: int, length: int) -> RoundResult:
        """One round of ``system`` (``runs`` runs of ``length`` steps) with its CPU use measured around it."""
        worker = self.workers[system.name]
        if system.kind == "dbos":  # it polls its queue: paused outside its own rounds
            worker.pause(False)
            time.sleep(0.2)
        database = self.database_of(system)
        cpu_before, pg_before = worker.cpu(), self.postgres_cpu(database)
        spec = rounds.RoundSpec(
            system.name,
            f"{label}{system.tag}-",
            number,
            runs,
            length,
            self.config.result_bytes,
            self.timings(system),
            self.config.timeout_s,
            self._check_workers,
        )
        if system.kind == "lousho":
            assert self._db is not None
            consumers = Consumers(self.consumer_client, self.config.timeout_s) if system.watched else None
            result = rounds.lousho_round(spec, self._db, self.client(system).agent(self.config.agent), consumers)
        elif system.kind == "dbos" and self.peer is not None:
            result = self.peer.round(spec)
        else:
            result = rounds.bare_round(spec, self.bare_app, system.queue)
        cpu_after, pg_after = worker.cpu(), self.postgres_cpu(database)
        result.worker_cpu_s = sum(v - cpu_before.get(pid, 0.0) for pid, v in cpu_after.items())
        main_pid = worker.process.pid
        result.worker_main_cpu_s = cpu_after.get(main_pid, 0.0) - cpu_before.get(main_pid, 0.0)
        result.postgres_cpu_s = sum(v - pg_before.get(pid, 0.0) for pid, v in pg_after.items())
        if system.kind == "dbos":
            worker.pause()
        if system.name == "floor":
            assert self._db is not None
            if floor.finished(self._db, spec.prefix, length) != runs:
                raise BenchError(f"a chain {spec.prefix}* of the floor did not save all its {length} hops")
        if self.config.continuation:
            self.check_continuation(system, result, spec.prefix)
        setting = dict(system.env).get("LOUSHO_EVENTS")
        if setting is not None:  # an ``--events`` variant: did its setting reach the worker?
            assert self._db is not None
            row = self._db.execute(
                "SELECT count(*) FROM run_events WHERE session_id LIKE %s", (spec.prefix + "%",)
            ).fetchone()
            result.events_stored = int(row[0]) if row else 0
            if (result.events_stored > 0) != (setting != "0"):
                raise BenchError(
                    f"the {system.name} worker's runs {spec.prefix}* stored {result.events_stored} "
                    f"event(s) with LOUSHO_EVENTS={setting}: the setting did not apply"
                )
        return result

    def check_continuation(self, system: System, result: RoundResult, prefix: str) -> None:
        """Whether ``--continue`` reached the workers: lousho-chain's tasks took several steps, lousho's one each.

        A step is chained when its save falls inside a timed task that had already saved one (``bench.results``).

        Raises:
            BenchError: lousho-chain chained no step (or none of its tasks was timed), or lousho chained one.
        """
        if system.name not in (CHAIN, "lousho") or result.chained_steps is None:
            return
        tasks = len(result.task_ms)
        if system.name == CHAIN and not result.chained_steps:
            raise BenchError(
                f"the {CHAIN} worker ran {tasks} timed step task(s) for {result.steps} steps of {prefix}*, and no"
                f" step in the same task as the one before: LOUSHO_CONTINUE_STEPS={self.config.continue_steps}"
                " did not apply"
            )
        if system.name == "lousho" and result.chained_steps:
            raise BenchError(
                f"the lousho worker took {result.chained_steps} step(s) of {prefix}* in the same task as the one"
                " before: it should take one step per task (a LOUSHO_CONTINUE_STEPS setting reached it)"
            )

    def warm_up(self) -> None:
        """Start every worker's pool processes (imports, connections, first-task costs), unmeasured."""
        runs = max(2 * self.config.concurrency, 4)
        for system in self.systems:
            self.run_round(system, "warm", 0, runs, self.config.warmup_hops)

    def postgres_cpu(self, database: str | None) -> dict[int, float]:
        """CPU seconds used so far by the server processes serving ``database`` (not ours); none for None."""
        assert self._db is not None
        if database is None:
            return {}
        ours = [self.peer.backend_pid] if self.peer is not None else []  # its completion polling
        rows = self._db.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid() AND NOT pid = ANY(%s)",
            (database, ours),
        ).fetchall()
        return {int(pid): cpu_seconds(int(pid)) for (pid,) in rows}

    def measure(self) -> list[RoundResult]:
        """Per run length (shortest first), the rounds, each system once per round in rotating order.

        Prints each round's row; after each length, records each worker's peak RSS so far.
        """
        results = []
        for length in self.config.lengths:
            for number in range(1, self.config.rounds + 1):
                shift = (number - 1) % len(self.systems)
                for system in self.systems[shift:] + self.systems[:shift]:
                    result = self.run_round(system, f"{length}r{number}", number, self.config.runs, length)
                    results.append(result)
                    print(format_row(result.summary()), flush=True)
            self.peak_rss[length] = {name: w.largest_rss_kib() for name, w in self.workers.items()}
        return results

    def storage(self) -> dict[str, Any]:
        """``--storage``: what the Lousho runs left in Postgres, and the WAL one run writes per step.

        Per Lousho worker, prints the bytes its measured runs left per table and length, then sends one run of
        the longest length alone and prints its WAL per step; returns both JSON-ready.
        """
        assert self._db is not None
        found: list[storage.Stored] = []
        wal: list[storage.WalRun] = []
        for system in self.systems:
            if system.kind != "lousho":
                continue
            mine = [storage.stored(self._db, system.name, system.tag, length) for length in self.config.lengths]
            storage.print_stored(mine, self.config.history_limit)
            found.extend(mine)
            handle = self.client(system).agent(self.config.agent)
            run = storage.wal_run(
                self._db,
                handle,
                f"wal{system.tag}-000",
                max(self.config.lengths),
                self.config.result_bytes,
                self.config.timeout_s,
                self._check_workers,
                system.name,
            )
            storage.print_wal(run, self.config.result_bytes, self.config.history_limit)
            wal.append(run)
        return storage.summaries(found, wal)

    def rss_soak(self) -> tuple[list[RoundResult], dict[str, Any]]:
        """``--rss-steps``: Lousho rounds of the longest length until that many steps are done, RSS after each.

        Prints the rounds with the pool processes' RSS and the comparison; returns the rounds and the figures.
        """
        system = self.systems[0]
        length = max(self.config.lengths)

        def take(number: int) -> RoundResult:
            return self.run_round(system, f"rss{number}", number, self.config.runs, length)

        results, readings = rss.soak(take, self.workers[system.name], self.config.rss_steps)
        figures = rss.flatness(readings)
        rss.print_flatness(figures, system.name)
        return results, figures


def _terminate(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _rounds_mode(bench: Bench, config: Config) -> None:
    """The interleaved rounds of every length, the summary, ``--storage``'s figures and the JSON file."""
    results = bench.measure()
    rss_peaks = {name: w.peak_rss_kib() for name, w in bench.workers.items()}
    summary = aggregate(results, bench.peak_rss, config.continue_ms if config.continuation else None)
    report(config, summary, rss_peaks)
    extra = {"storage": bench.storage()} if config.storage else {}
    if config.json_path is not None:
        print(f"results written to {write_json(config, results, summary, rss_peaks, extra)}")


def _rss_mode(bench: Bench, config: Config) -> None:
    """``--rss-steps``: the Lousho rounds with the worker's RSS after each, the comparison and the JSON file."""
    results, figures = bench.rss_soak()
    if config.json_path is not None:
        rss_peaks = {name: w.peak_rss_kib() for name, w in bench.workers.items()}
        summary = aggregate(results, {})
        print(f"results written to {write_json(config, results, summary, rss_peaks, {'rss': figures})}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark.

    Returns:
        0 on success, 1 when it could not complete, 2 when the peer asked for could not be measured (the
        others were), 130 when interrupted.
    """
    config = parse_args(argv)
    peer_missing = dbos_peer.missing() if config.peer == "dbos" else None
    if peer_missing:
        print(peer_missing, file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started with SIGINT ignored
    workdir = Path(tempfile.mkdtemp(prefix="lousho-bench-"))
    bench = Bench(config, workdir)
    keep = True
    try:
        print(f"preparing database {config.database} and Redis db {config.redis_db}", flush=True)
        bench.prepare_services()
        bench.start_workers()
        print(f"workers started ({', '.join(bench.workers)}; prefork -c {config.concurrency}); warming up", flush=True)
        bench.warm_up()
        print(HEADER, flush=True)
        if config.rss_steps:
            _rss_mode(bench, config)
        else:
            _rounds_mode(bench, config)
        keep = False
        if peer_missing:
            print(f"the DBOS peer was not measured: {peer_missing}", file=sys.stderr)
            return 2
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted; stopping workers", file=sys.stderr)
        keep = False
        return 130
    except (BenchError, psycopg.Error, redis.RedisError, OSError) as exc:
        print(
            f"benchmark failed: {type(exc).__name__}: {exc}\nworker logs and timings kept in {workdir}", file=sys.stderr
        )
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
