"""What one benchmark invocation measures and against which services: ``Config`` and the command line.

It only describes the run; starting workers, timing rounds and reporting live elsewhere.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench import agents as bench_agents

ROOT = Path(__file__).resolve().parent.parent

#: ``--events`` variants of the Lousho worker, in the order they are measured: saves write events (the
#: default), saves write none (``LOUSHO_EVENTS=0``), or they do and a consumer follows every run.
EVENT_VARIANTS = ("on", "off", "watched")
#: ``--continue`` variants, in the order they are measured: a worker whose tasks take a run's next steps
#: themselves (``on``: the system ``lousho-chain``), and the worker as deployed by default (``off``: ``lousho``).
CONTINUE_VARIANTS = ("on", "off")
#: The ``--continue on`` system: a Lousho worker of this tree whose tasks take a run's next steps themselves.
CHAIN = "lousho-chain"


@dataclass(frozen=True)
class Config:
    """What one invocation measures, and against which services."""

    runs: int = 20
    hops: tuple[int, ...] = (21,)
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
    result_bytes: int = 0
    peer: str | None = None
    #: Also the ``floor`` system: bare Celery hops that make a strict Lousho step's round trips (``bench.floor``).
    floor: bool = False
    dbos_polling_s: float = 0.05
    storage: bool = False
    rss_steps: int = 0
    events: tuple[str, ...] = ()  # ``EVENT_VARIANTS`` measured side by side; empty: the Lousho worker as it is
    #: Celery task events (worker and sender) for every Celery worker measured, Lousho's and bare alike.
    task_events: bool = True
    #: ``CONTINUE_VARIANTS`` measured side by side; empty: the Lousho worker as it is (one step per task).
    continuation: tuple[str, ...] = ()
    #: ``LOUSHO_CONTINUE_STEPS`` and ``LOUSHO_CONTINUE_MS`` of the ``lousho-chain`` worker.
    continue_steps: int = 1000
    continue_ms: int = 100

    @property
    def agent(self) -> str:
        """The bench agent the Lousho runs use."""
        return bench_agents.USAGE_AGENT if self.usage else bench_agents.AGENT

    @property
    def lengths(self) -> list[int]:
        """Steps one run really takes, for each asked length, shortest first (odd; see ``bench.agents``)."""
        return sorted({bench_agents.steps_for(hops) for hops in self.hops})

    @property
    def database_url(self) -> str:
        """The bench database's URL: ``server_url`` with its database name replaced by ``database``."""
        base, _, query = self.server_url.partition("?")
        base = base.rsplit("/", 1)[0] if base.count("/") >= 3 else base
        return f"{base}/{self.database}" + (f"?{query}" if query else "")

    @property
    def dbos_database(self) -> str:
        """The DBOS peer's system database, next to the bench database on the same server."""
        return f"{self.database}_dbos"

    @property
    def dbos_database_url(self) -> str:
        """The DBOS peer's system database URL (same server, user and query as ``database_url``)."""
        base, _, query = self.database_url.partition("?")
        return f"{base.rsplit('/', 1)[0]}/{self.dbos_database}" + (f"?{query}" if query else "")

    @property
    def bench_redis_url(self) -> str:
        """The bench Redis URL: ``redis_url`` with its db number replaced by ``redis_db``."""
        base, _, query = self.redis_url.partition("?")
        parts = base.rstrip("/").split("/")
        if len(parts) > 3 and parts[-1].isdigit():
            parts = parts[:-1]
        return "/".join(parts) + f"/{self.redis_db}" + (f"?{query}" if query else "")

    @property
    def history_limit(self) -> int:
        """Production default (50), raised when runs are longer so every step keeps its row."""
        return max(50, max(self.lengths) + 1)


def parse_args(argv: Sequence[str] | None) -> Config:
    """The command line as a ``Config``."""
    defaults = Config()
    parser = argparse.ArgumentParser(
        prog="python -m bench", description="Lousho steps/s and per-step overhead against a bare Celery chain."
    )
    parser.add_argument("--runs", type=int, default=defaults.runs, help="concurrent runs (and chains) per round")
    parser.add_argument(
        "--hops",
        type=_lengths,
        default=defaults.hops,
        metavar="N[,N...]",
        help="steps per run, one or more comma-separated lengths measured in turn; each rounded up "
        "to odd (tool turns come in pairs, plus the final turn)",
    )
    parser.add_argument(
        "--result-bytes",
        type=int,
        default=defaults.result_bytes,
        metavar="N",
        help="bytes of text each tool call returns (0: 'ok'); the bare chain carries as many",
    )
    parser.add_argument(
        "--peer",
        choices=["dbos"],
        help="also measure the same work as DBOS workflow steps (needs the optional dbos package)",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also measure the bare chain with a strict Lousho step's round trips on each hop (lease, fenced claim"
        " and save, release): what the durable hand-over costs, without Lousho's own code",
    )
    parser.add_argument(
        "--dbos-polling",
        type=float,
        default=defaults.dbos_polling_s,
        metavar="S",
        help="queue polling interval of the DBOS peer's processes (DBOS's default is 1 s)",
    )
    parser.add_argument("--rounds", type=int, default=defaults.rounds, help="rounds of each system, interleaved")
    parser.add_argument(
        "--concurrency", type=int, default=defaults.concurrency, help="prefork processes of each worker"
    )
    parser.add_argument(
        "--json",
        nargs="?",
        const="",
        default=None,
        metavar="PATH",
        help="write the results as JSON (default path: bench/results/bench-<time>.json)",
    )
    parser.add_argument(
        "--server-url",
        default=os.environ.get("LOUSHO_BENCH_SERVER_URL", defaults.server_url),
        help="Postgres server URL (the bench database is created next to it)",
    )
    parser.add_argument("--database", default=defaults.database, help="database to drop and recreate")
    parser.add_argument("--redis-url", default=os.environ.get("LOUSHO_BENCH_REDIS_URL", defaults.redis_url))
    parser.add_argument("--redis-db", type=int, default=defaults.redis_db, help="Redis db to flush and use")
    parser.add_argument("--loglevel", default=defaults.loglevel, help="worker log level (both workers)")
    parser.add_argument("--timeout", type=float, default=defaults.timeout_s, help="seconds allowed per round")
    parser.add_argument(
        "--usage",
        action="store_true",
        help="the model reports token usage like a real provider (one more write per model turn)",
    )
    parser.add_argument(
        "--other-tree",
        metavar="PATH",
        help="also measure a Lousho worker started from this copy of the project (same schema)",
    )
    parser.add_argument(
        "--storage",
        action="store_true",
        help="after the rounds, the bytes the Lousho runs' rows occupy per table, and the WAL "
        "bytes per step early and late in one run of the longest length, alone",
    )
    parser.add_argument(
        "--rss-steps",
        type=int,
        default=defaults.rss_steps,
        metavar="N",
        help="instead of the rounds: Lousho rounds of --runs runs of the longest --hops until N "
        "steps are done, the pool processes' RSS read after each",
    )
    parser.add_argument(
        "--events",
        type=_variants_of(EVENT_VARIANTS),
        default=defaults.events,
        metavar="on,off[,watched]",
        help="Lousho workers side by side with saves writing events (on), writing none "
        "(off: LOUSHO_EVENTS=0), or writing them with a consumer following every run "
        "(watched), and what events cost per step",
    )
    parser.add_argument(
        "--task-events",
        choices=["on", "off"],
        default="on" if defaults.task_events else "off",
        help="Celery task events, sent by workers and senders, on both sides (LOUSHO_TASK_EVENTS; "
        "on: as deployed, where Flower lists the steps)",
    )
    parser.add_argument(
        "--continue",
        dest="continuation",
        type=_variants_of(CONTINUE_VARIANTS),
        default=defaults.continuation,
        metavar="on,off",
        help="Lousho workers side by side whose tasks take a run's next steps themselves (on: lousho-chain, "
        "LOUSHO_CONTINUE_STEPS / LOUSHO_CONTINUE_MS) or one step per task (off: lousho, the default)",
    )
    parser.add_argument(
        "--continue-steps", type=int, default=defaults.continue_steps, help="LOUSHO_CONTINUE_STEPS of lousho-chain"
    )
    parser.add_argument(
        "--continue-ms", type=int, default=defaults.continue_ms, help="LOUSHO_CONTINUE_MS of lousho-chain"
    )
    args = parser.parse_args(argv)
    if args.continue_steps < 2 or args.continue_ms < 1:
        parser.error("--continue-steps must be at least 2 and --continue-ms at least 1")
    if args.continuation and args.events:
        parser.error("--continue and --events each measure Lousho workers side by side: one of them at a time")
    for name in ("runs", "rounds", "concurrency"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.result_bytes < 0 or args.dbos_polling <= 0:
        parser.error("--result-bytes must be at least 0 and --dbos-polling above 0")
    if args.rss_steps < 0:
        parser.error("--rss-steps must be at least 0")
    if args.rss_steps and (args.peer or args.other_tree or args.storage or args.events or args.floor):
        parser.error(
            "--rss-steps measures the Lousho worker alone: without --peer, --other-tree, --storage, --events or --floor"
        )
    if args.other_tree is not None:
        other = Path(args.other_tree).resolve()
        if not (other / "worker" / "celery.py").exists():
            parser.error(f"--other-tree {other} does not look like a copy of the project")
        args.other_tree = str(other)
    return Config(
        runs=args.runs,
        hops=args.hops,
        rounds=args.rounds,
        concurrency=args.concurrency,
        server_url=args.server_url,
        database=args.database,
        redis_url=args.redis_url,
        redis_db=args.redis_db,
        loglevel=args.loglevel,
        timeout_s=args.timeout,
        json_path=args.json,
        usage=args.usage,
        other_tree=args.other_tree,
        result_bytes=args.result_bytes,
        peer=args.peer,
        floor=args.floor,
        dbos_polling_s=args.dbos_polling,
        storage=args.storage,
        rss_steps=args.rss_steps,
        events=args.events,
        task_events=args.task_events == "on",
        continuation=args.continuation,
        continue_steps=args.continue_steps,
        continue_ms=args.continue_ms,
    )


def _lengths(text: str) -> tuple[int, ...]:
    """``--hops``: one or more comma-separated positive integers."""
    try:
        lengths = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError("every length must be at least 1")
    return lengths


def _variants_of(known: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    """The parser of a flag naming one or more of ``known``, comma-separated; they come back in ``known``'s order."""

    def parse(text: str) -> tuple[str, ...]:
        asked = {part.strip() for part in text.split(",") if part.strip()}
        if not asked or asked - set(known):
            raise argparse.ArgumentTypeError(f"expected one or more of {', '.join(known)}, got {text!r}")
        return tuple(variant for variant in known if variant in asked)

    return parse
