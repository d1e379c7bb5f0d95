"""``lousho dev`` and ``lousho demo``: development services in the foreground, and the crash demo.

``devkit`` is imported here only, inside the commands, so the rest of ``producer`` never loads it.
Both commands print a log, not a result: they refuse ``--json``.
"""

from __future__ import annotations

import argparse

from producer.cli.output import refuse_json
from producer.client import Client


def cmd_demo(client: Client, args: argparse.Namespace) -> int:
    """``lousho demo``: a run survives a killed worker (configured services, else embedded ones).

    Raises:
        EmbeddedError: an embedded server could not be started (``LOUSHO_EMBEDDED_FAILED``).
    """
    from devkit.demo import run_demo
    from devkit.devserver import dev_services

    with dev_services() as settings:
        return run_demo(settings)


def cmd_dev(client: Client, args: argparse.Namespace) -> int:
    """``lousho dev``: worker and beat in the foreground until Ctrl-C; ``--stop`` stops embedded servers left running.

    Raises:
        EmbeddedError: an embedded server could not be started or stopped (``LOUSHO_EMBEDDED_FAILED``).
    """
    from devkit.devserver import run_dev, stop_services

    if args.stop:
        stop_services()
        print("stopped the embedded PostgreSQL and Redis")
        return 0
    return run_dev(
        None,
        concurrency=args.concurrency,
        flower=args.flower,
        flower_port=args.flower_port,
        keep_services=args.keep_services,
    )


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``lousho demo`` and ``lousho dev`` to the ``lousho`` parser."""
    demo = sub.add_parser("demo", help="show a run surviving a killed worker")
    refuse_json(demo, "lousho demo prints a timeline as it goes").set_defaults(fn=cmd_demo)
    dev = sub.add_parser(
        "dev",
        help="run a worker and beat in the foreground, on embedded Postgres and Redis "
        "unless LOUSHO_DATABASE_URL / LOUSHO_REDIS_URL are set (Ctrl-C stops "
        "everything)",
    )
    refuse_json(dev, "lousho dev runs in the foreground and prints a log")
    dev.add_argument("--concurrency", type=int, default=2, help="worker processes")
    dev.add_argument("--flower", action="store_true", help="also run Flower on 127.0.0.1 (needs flower)")
    dev.add_argument("--flower-port", type=int, default=5555)
    dev.add_argument("--keep-services", action="store_true", help="leave the embedded servers running on exit")
    dev.add_argument("--stop", action="store_true", help="stop embedded servers left running, then exit")
    dev.set_defaults(fn=cmd_dev)
