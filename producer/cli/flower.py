"""``lousho flower``: Flower on Lousho's app (or a team's own), with authentication and the columns that show runs.

A bare ``celery -A worker flower`` runs without authentication (Flower 2 then answers 401 to its own HTTP API) and
shows its default columns, which hide a step's keyword arguments (run id and seq), result and exception. This
command refuses to start without credentials and starts ``celery -A <app> flower`` in its own place (``exec``:
signals reach Flower directly); Celery, Flower and the app are never imported here.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from importlib.util import find_spec
from pathlib import Path

from producer.cli.output import refuse_json
from producer.client import Client
from store import errors

#: The tasks page's columns: a step's name (agent and kind), id, state, kwargs (run id and seq), result and
#: exception, when it was received, how long it ran and where.
COLUMNS = ("name", "uuid", "state", "kwargs", "result", "exception", "received", "runtime", "worker")
#: Flower's own settings that give it authentication (either one).
AUTH_VARIABLES = ("FLOWER_BASIC_AUTH", "FLOWER_AUTH_PROVIDER")


def flower_argv(celery: str, args: argparse.Namespace) -> list[str]:
    """The ``celery ... flower`` command line ``lousho flower`` runs."""
    extra = [arg for arg in args.flower_args if arg != "--"]
    return [
        celery,
        "-A",
        args.app,
        "flower",
        f"--address={args.address}",
        f"--port={args.port}",
        f"--tasks_columns={','.join(COLUMNS)}",
        *extra,
    ]


def cmd_flower(client: Client, args: argparse.Namespace) -> int:
    """``lousho flower``: replace this process with Flower; returns only when it cannot start.

    Raises:
        ConfigurationError: neither ``FLOWER_BASIC_AUTH`` nor ``FLOWER_AUTH_PROVIDER`` is set, or Flower or the
            ``celery`` command is not installed.
    """
    if not any(os.environ.get(name) for name in AUTH_VARIABLES):
        raise errors.ConfigurationError(
            "Flower never runs without authentication: set FLOWER_BASIC_AUTH=user:password (behind TLS or on a"
            " private network), or FLOWER_AUTH_PROVIDER with an anchored FLOWER_AUTH regex",
            variable="FLOWER_BASIC_AUTH",
        )
    if find_spec("flower") is None:
        raise errors.ConfigurationError("Flower is not installed: pip install 'lousho-worker[flower]'")
    beside = Path(sys.executable).with_name("celery")
    celery = str(beside) if beside.exists() else shutil.which("celery")
    if celery is None:
        raise errors.ConfigurationError("the celery command is not installed")
    argv = flower_argv(celery, args)
    print(f"starting Flower on http://{args.address}:{args.port} (app {args.app})", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os.execv(celery, argv)
    return 1  # not reached: execv returns only by raising


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``lousho flower`` to the ``lousho`` parser."""
    flower = sub.add_parser("flower", help="start Flower with authentication and the columns that show runs")
    flower.add_argument(
        "--app",
        default="worker",
        help="the Celery app (celery -A): worker, or your app given to install() (default: worker)",
    )
    flower.add_argument("--address", default="127.0.0.1", help="the address to listen on (default: 127.0.0.1)")
    flower.add_argument("--port", type=int, default=5555)
    flower.add_argument(
        "flower_args", nargs=argparse.REMAINDER, help="more Flower options after --, e.g. -- --url_prefix=flower"
    )
    refuse_json(flower, "lousho flower runs a server and prints its log")
    flower.set_defaults(fn=cmd_flower)
