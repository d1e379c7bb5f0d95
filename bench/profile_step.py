"""Where a Lousho step's time goes: ``run_step`` called in a loop in one process, phase by phase.

``python -m bench.profile_step`` builds the worker's real step dependencies (``worker.tasks.deps``:
pooled engine, Redis client, lease manager, heartbeat, Celery producer) against its own database
(``lousho_bench_profile``) and Redis db (12), sends ``--runs`` runs of the bench agent, then calls
``run_step`` round-robin over them until they finish, the way a worker would but without Celery's
delivery. Each dependency the step calls is wrapped with a timer, so the table shows lease, claim
(with its pool checkout and row parsing), model, tool, save (with serialization), release and
enqueue (a real publish to a queue nobody consumes), and what is left for the step's own Python.

``--engine`` runs the same loop with another engine for the checkpoint store, to measure what
the connection handling costs: ``default`` (``store.database.make_engine``), ``no-pre-ping``
(the same without ``pool_pre_ping``), ``autocommit`` (no pre-ping, and each statement is its own
transaction: no separate BEGIN and COMMIT round trips). Nothing in the project is changed.

``--cprofile N`` also prints the N functions with the most own time under ``cProfile``.
Celery's delivery and ack are not in this loop; ``python -m bench --runs 1`` shows them as the
difference between the per-step and in-task times.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import os
import pstats
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
import redis

from bench.run import Config, percentile

DATABASE = "lousho_bench_profile"
REDIS_DB = 12
QUEUE = "bench-profile"

_spent: dict[str, list[float]] = defaultdict(list)


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` recording its duration under ``name``."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _spent[name].append(time.perf_counter() - started)
    return wrapper


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_step", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="runs stepped round-robin")
    parser.add_argument("--hops", type=int, default=41, help="steps per run (rounded up to odd)")
    parser.add_argument("--repeat", type=int, default=3, help="batches of runs (the first one is a warm-up)")
    parser.add_argument("--engine", choices=["default", "no-pre-ping", "autocommit"], default="default")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N", help="print the top N functions")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    config = Config(database=DATABASE, redis_db=REDIS_DB)
    # The worker modules read their settings at import: point them at the profile's services first.
    os.environ.update({
        "LOUSHO_DATABASE_URL": config.database_url, "LOUSHO_REDIS_URL": config.bench_redis_url,
        "LOUSHO_AGENTS": "bench.agents", "LOUSHO_QUEUE": QUEUE,
        "LOUSHO_HISTORY_LIMIT": str(config.history_limit),
    })
    os.environ.pop("BENCH_TIMINGS", None)

    from sqlalchemy import create_engine

    import store.checkpoints
    import store.payloads
    import worker.machine
    from bench import agents as bench_agents
    from producer import Client
    from store.checkpoints import PostgresCheckpointStore
    from store.database import migrate
    from store.records import Checkpoint
    from store.settings import Settings
    from worker import tasks
    from worker.steps import run_step

    settings = Settings()
    with psycopg.connect(config.server_url, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{DATABASE}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{DATABASE}"')
    migrate(settings)
    broker = redis.Redis.from_url(config.bench_redis_url)
    broker.flushdb()

    deps = tasks.deps()
    if args.engine != "default":
        options: dict[str, Any] = {"pool_size": 2, "max_overflow": 4, "pool_pre_ping": False, "hide_parameters": True,
                                   "connect_args": {"connect_timeout": 5, "application_name": "lousho"}}
        if args.engine == "autocommit":
            options["isolation_level"] = "AUTOCOMMIT"
        deps.store = PostgresCheckpointStore(create_engine(settings.sqlalchemy_url, **options),
                                             settings.history_limit)

    # Wrap everything the step calls (instance attributes shadow the methods; module functions are
    # looked up at call time). Sub-phases are reported inside their phase.
    next_seq: dict[str, int | None] = {}
    enqueue = timed("enqueue (Celery publish)", deps.enqueue)

    def capture(session_id: str, seq: int | None, countdown: float = 0.0) -> None:
        next_seq[session_id] = seq
        enqueue(session_id, seq, countdown)

    deps.enqueue = capture
    deps.leases.acquire = timed("lease acquire (Lua SET NX + INCR)", deps.leases.acquire)  # type: ignore[method-assign]
    deps.leases.release = timed("lease release (Lua compare-and-delete)", deps.leases.release)  # type: ignore[method-assign]
    deps.heartbeat.hold = timed("heartbeat hold+drop", deps.heartbeat.hold)  # type: ignore[method-assign]
    deps.heartbeat.drop = timed("heartbeat hold+drop", deps.heartbeat.drop)  # type: ignore[method-assign]
    deps.store.claim = timed("claim-and-load", deps.store.claim)  # type: ignore[method-assign]
    deps.store.inbox = timed("inbox read (first step only)", deps.store.inbox)  # type: ignore[method-assign]
    deps.store.save = timed("fenced save + history", deps.store.save)  # type: ignore[method-assign]
    dialect = deps.store.engine.dialect
    dialect.do_ping = timed("  pool pre-ping (SELECT 1)", dialect.do_ping)  # type: ignore[method-assign]
    store.checkpoints._checkpoint = timed("  row -> Checkpoint (pydantic)", store.checkpoints._checkpoint)
    store.payloads.dumps = timed("  json dumps", store.payloads.dumps)
    Checkpoint.document = timed("  Checkpoint.document (model_dump)", Checkpoint.document)  # type: ignore[method-assign]
    worker.machine.plan = timed("plan (pure step machine)", worker.machine.plan)
    agent = deps.agents[bench_agents.AGENT]
    agent.model.generate = timed("model turn (MockModel)", agent.model.generate)  # type: ignore[method-assign]
    noop = agent.tools["noop"]
    noop.invoke = timed("tool call (no-op, validated)", noop.invoke)  # type: ignore[method-assign]

    client = Client(settings)
    handle = client.agent(bench_agents.AGENT)
    message = bench_agents.input_for(args.hops)
    profiler = cProfile.Profile() if args.cprofile else None
    totals: list[float] = []
    steps = 0
    loop_time = 0.0
    for batch in range(args.repeat):
        ids = [f"p{batch}-{i:03d}" for i in range(args.runs)]
        for session_id in ids:
            handle.send(message, session_id=session_id, check_agent=False)
            next_seq[session_id] = None
        if batch == 0:
            _spent.clear()  # the first batch warms connections, caches and the heartbeat thread
        active = list(ids)
        started = time.perf_counter()
        if profiler is not None and batch > 0:
            profiler.enable()
        while active:
            for session_id in list(active):
                seq = next_seq.pop(session_id)
                before = time.perf_counter()
                run_step(deps, session_id, seq)
                if batch > 0:
                    totals.append(time.perf_counter() - before)
                    steps += 1
                if session_id not in next_seq:  # no next step enqueued: the run finished
                    active.remove(session_id)
        if profiler is not None:
            profiler.disable()
        if batch == 0:
            _spent.clear()
        else:
            loop_time += time.perf_counter() - started

    deps.heartbeat.stop()
    client.close()
    broker.flushdb()

    _report(args, totals, steps, loop_time)
    if profiler is not None:
        print(f"\ncProfile, top {args.cprofile} functions by own time (measured batches only):")
        stats = pstats.Stats(profiler, stream=sys.stdout)
        stats.sort_stats("tottime").print_stats(args.cprofile)
    return 0


def _report(args: argparse.Namespace, totals: list[float], steps: int, loop_time: float) -> None:
    total_ms = sum(totals) * 1000
    per_step = total_ms / steps
    print(f"{steps} steps of {args.runs} runs x {args.repeat - 1} measured batch(es), engine={args.engine}: "
          f"{steps / loop_time:.0f} steps/s in one process, run_step p50 {percentile(totals, 50) * 1000:.2f} ms, "
          f"p99 {percentile(totals, 99) * 1000:.2f} ms")
    print(f"{'phase':<42} {'calls':>6} {'p50 ms':>8} {'mean ms':>8} {'ms/step':>8} {'share':>6}")
    accounted = 0.0
    for name, spent in _spent.items():
        ms = sum(spent) * 1000
        if not name.startswith("  "):
            accounted += ms
        print(f"{name:<42} {len(spent):>6} {percentile(spent, 50) * 1000:>8.3f} {ms / len(spent):>8.3f} "
              f"{ms / steps:>8.3f} {ms / total_ms:>6.1%}")
    rest = total_ms - accounted
    print(f"{'rest (step Python: copies, checks, logging)':<42} {'':>6} {'':>8} {'':>8} {rest / steps:>8.3f} "
          f"{rest / total_ms:>6.1%}")
    print(f"{'total run_step':<42} {steps:>6} {percentile(totals, 50) * 1000:>8.3f} {per_step:>8.3f} "
          f"{per_step:>8.3f} {1:>6.1%}")


if __name__ == "__main__":
    sys.exit(main())
