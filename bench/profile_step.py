"""Where a Lousho step's time goes: ``run_step`` called in a loop in one process, phase by phase.

``python -m bench.profile_step`` builds the worker's real step dependencies (``worker.tasks.deps``:
pooled engine, Redis client, lease manager, heartbeat, Celery producer) against its own database
(``lousho_bench_profile``) and Redis db (12), sends ``--runs`` runs of the bench agent, then calls
``run_step`` round-robin over them until they finish, the way a worker would but without Celery's
delivery. Each dependency the step calls is wrapped with a timer, so the table shows lease, claim
(with its pool checkout and row parsing), model, tool, save (with serialization), release and
enqueue (a real publish to a queue nobody consumes), and what is left for the step's own Python.

``--engine`` runs the same loop with another engine for the checkpoint store, to measure what
the connection handling costs: ``default`` (``store.database.make_engine``: the step's statements on
the driver directly, a dead pooled connection found by its readable socket) and ``pre-ping`` (the same
with SQLAlchemy's ``pool_pre_ping``, a ``SELECT 1`` round trip before every checkout). Several
variants, comma-separated, are measured in alternating batches. Nothing in the project is changed.

``--usage`` runs the agent whose model reports token usage like a real provider (each model turn
then also writes its usage note before the save). ``--cprofile N`` also prints the N functions
with the most own time under ``cProfile``. Celery's delivery and ack are not in this loop;
``python -m bench --runs 1`` shows them (the "gap" column).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psycopg
import redis

from bench import agents as bench_agents
from bench import phases
from bench.config import Config
from bench.results import percentile

if TYPE_CHECKING:
    from store.checkpoints import PostgresCheckpointStore
    from worker.context import StepDeps

DATABASE = "lousho_bench_profile"
REDIS_DB = 12
QUEUE = "bench-profile"
ENGINES = ("default", "pre-ping")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line, with ``engines`` the list of engine variants to measure."""
    parser = argparse.ArgumentParser(prog="python -m bench.profile_step", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="runs stepped round-robin per batch")
    parser.add_argument("--hops", type=int, default=41, help="steps per run (rounded up to odd)")
    parser.add_argument("--repeat", type=int, default=3, help="measured batches per engine variant")
    parser.add_argument(
        "--engine",
        default="default",
        help=f"comma-separated store engine variants, measured in alternation: {', '.join(ENGINES)}",
    )
    parser.add_argument("--cprofile", type=int, default=0, metavar="N", help="print the top N functions")
    parser.add_argument(
        "--usage", action="store_true", help="the model reports token usage like a real provider (adds the usage note)"
    )
    args = parser.parse_args(argv)
    args.engines = [e.strip() for e in args.engine.split(",") if e.strip()]
    unknown = set(args.engines) - set(ENGINES)
    if unknown or not args.engines:
        parser.error(f"unknown engine variant(s): {', '.join(sorted(unknown)) or '(none)'}")
    return args


@dataclass
class _Tally:
    """Per variant: each ``run_step``'s wall and CPU time and the loops' wall time; outcomes of all batches."""

    totals: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    cpu_totals: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    loop_time: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    outcomes: dict[str, int] = field(default_factory=lambda: defaultdict(int))


def main(argv: Sequence[str] | None = None) -> int:
    """Profile ``run_step`` phase by phase (``python -m bench.profile_step``); 0 when it is done."""
    args = parse_args(argv)
    config = Config(database=DATABASE, redis_db=REDIS_DB)
    # The worker modules read their settings at import: point them at the profile's services first.
    os.environ.update(
        {
            "LOUSHO_DATABASE_URL": config.database_url,
            "LOUSHO_REDIS_URL": config.bench_redis_url,
            "LOUSHO_AGENTS": "bench.agents",
            "LOUSHO_QUEUE": QUEUE,
            "LOUSHO_HISTORY_LIMIT": str(config.history_limit),
        }
    )
    os.environ.pop("BENCH_TIMINGS", None)

    from producer import Client
    from store.database import migrate
    from store.settings import Settings
    from worker import tasks
    from worker.celery import app

    # The step task is a shared task: without Lousho's app made current it would publish through Celery's
    # default app (an AMQP broker on localhost), not the Redis broker a worker publishes to.
    app.set_current()
    app.set_default()

    settings = Settings()
    with psycopg.connect(config.server_url, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{DATABASE}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{DATABASE}"')
    migrate(settings)
    broker = redis.Redis.from_url(config.bench_redis_url)
    broker.flushdb()

    deps = tasks.deps()
    stores = phases.instrument_stores(deps, settings, args.engines)
    next_seq = phases.instrument_step_calls(deps)
    agent_name = bench_agents.USAGE_AGENT if args.usage else bench_agents.AGENT
    phases.instrument_agent(deps, agent_name)

    client = Client(settings)
    profiler = cProfile.Profile() if args.cprofile else None
    tally = _measure(args, deps, stores, next_seq, client.agent(agent_name), profiler)

    deps.heartbeat.stop()
    client.close()
    broker.flushdb()

    for variant in args.engines:
        _report(args, variant, tally.totals[variant], tally.cpu_totals[variant], tally.loop_time[variant])
    print("outcomes (all batches): " + ", ".join(f"{name} {count}" for name, count in sorted(tally.outcomes.items())))
    if len(args.engines) > 1:
        _compare(args.engines, tally.totals)
    if profiler is not None:
        print(f"\ncProfile, top {args.cprofile} functions by own time (measured batches only):")
        stats = pstats.Stats(profiler, stream=sys.stdout)
        stats.sort_stats("tottime").print_stats(args.cprofile)
    return 0


def _measure(
    args: argparse.Namespace,
    deps: StepDeps,
    stores: dict[str, PostgresCheckpointStore],
    next_seq: dict[str, int | None],
    handle: Any,
    profiler: cProfile.Profile | None,
) -> _Tally:
    """A warm-up batch, then ``--repeat`` batches of each variant in alternating order, each stepped to its end."""
    message = bench_agents.input_for(args.hops)
    tally = _Tally()
    schedule = [("warm-up", args.engines[0])]
    for batch in range(args.repeat):
        order = args.engines if batch % 2 == 0 else list(reversed(args.engines))
        schedule += [(variant, variant) for variant in order]
    for number, (label, variant) in enumerate(schedule):
        phases.current[0] = label
        deps.store = stores[variant]
        ids = [f"p{number}-{i:03d}" for i in range(args.runs)]
        for session_id in ids:
            handle.send(message, session_id=session_id, check_agent=False)
            next_seq[session_id] = None
        measured = label != "warm-up"
        started = time.perf_counter()
        if profiler is not None and measured:
            profiler.enable()
        _step_to_the_end(deps, ids, next_seq, tally, label)
        if profiler is not None:
            profiler.disable()
        tally.loop_time[label] += time.perf_counter() - started
    return tally


def _step_to_the_end(
    deps: StepDeps, ids: list[str], next_seq: dict[str, int | None], tally: _Tally, label: str
) -> None:
    """Call ``run_step`` round-robin over the runs ``ids`` until each has finished, timing every call."""
    from worker.steps import run_step

    active = list(ids)
    while active:
        for session_id in list(active):
            seq = next_seq.pop(session_id)
            before, cpu = time.perf_counter(), time.thread_time()
            outcome = run_step(deps, session_id, seq)
            tally.totals[label].append(time.perf_counter() - before)
            tally.cpu_totals[label].append(time.thread_time() - cpu)
            tally.outcomes[outcome.value] += 1
            if session_id not in next_seq:  # no next step enqueued: the run finished
                active.remove(session_id)


def _compare(engines: list[str], totals: dict[str, list[float]]) -> None:
    """Print claim, save and whole-step time per step of each engine variant, side by side."""
    print("\ncomparison (ms per step, mean):")
    for variant in engines:
        spent = phases.spent[variant]
        steps = len(totals[variant])
        claim = sum(spent["claim-and-load"]) * 1000 / steps
        save = sum(spent["fenced save + history"]) * 1000 / steps
        total = sum(totals[variant]) * 1000 / steps
        print(
            f"  {variant:<12} claim {claim:6.3f}  save {save:6.3f}  run_step {total:6.3f}  "
            f"p50 {percentile(totals[variant], 50) * 1000:6.3f}"
        )


def _report(
    args: argparse.Namespace, variant: str, totals: list[float], cpu_totals: list[float], loop_time: float
) -> None:
    """Print ``variant``'s table: wall and CPU time per step of each phase, the rest, and the whole step."""
    steps = len(totals)
    total_ms = sum(totals) * 1000
    cpu_ms = sum(cpu_totals) * 1000
    print(
        f"\nengine={variant}: {steps} steps ({args.runs} runs x {args.repeat} batch(es)), "
        f"{steps / loop_time:.0f} steps/s in one process, run_step p50 {percentile(totals, 50) * 1000:.2f} ms, "
        f"p99 {percentile(totals, 99) * 1000:.2f} ms"
    )
    print("  wall = elapsed time, cpu = this process's CPU time; per step = total over steps")
    print(f"{'phase':<42} {'calls':>6} {'p50 ms':>7} {'wall/step':>9} {'cpu/step':>8} {'wall %':>7}")
    accounted = accounted_cpu = 0.0
    for name, spent in phases.spent[variant].items():
        ms = sum(spent) * 1000
        cpu = sum(phases.cpu[variant][name]) * 1000
        if not name.startswith("  "):
            accounted += ms
            accounted_cpu += cpu
        print(
            f"{name:<42} {len(spent):>6} {percentile(spent, 50) * 1000:>7.3f} {ms / steps:>9.3f} "
            f"{cpu / steps:>8.3f} {ms / total_ms:>7.1%}"
        )
    rest, rest_cpu = total_ms - accounted, cpu_ms - accounted_cpu
    print(
        f"{'rest (step Python: copies, checks, logging)':<42} {'':>6} {'':>7} {rest / steps:>9.3f} "
        f"{rest_cpu / steps:>8.3f} {rest / total_ms:>7.1%}"
    )
    print(
        f"{'total run_step':<42} {steps:>6} {percentile(totals, 50) * 1000:>7.3f} {total_ms / steps:>9.3f} "
        f"{cpu_ms / steps:>8.3f} {1:>7.1%}"
    )


if __name__ == "__main__":
    sys.exit(main())
