"""The ``lousho`` command: its parser, ``--version`` and the error boundary; each command group has a module.

Errors of the Lousho family print their stable code (JSON with ``--json``) and exit 1; usage errors exit 2.
Commands call the client; nothing here holds rules of its own, and ``devkit`` loads only for ``dev``/``demo``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from importlib import metadata

from producer.cli import (
    approvals,
    dev,
    doctor,
    flower,
    listing,
    output,
    prune,
    recordings,
    runs,
    storage,
    watch,
    webhooks,
)
from producer.cli import schedules as schedule_commands
from producer.client import Client
from store import errors
from store.settings import load_settings

__all__ = ["DISTRIBUTION", "build_parser", "main", "version"]

#: The installed distribution whose version ``lousho --version`` prints.
DISTRIBUTION = "lousho-worker"


def version() -> str:
    """The installed version of ``lousho-worker`` (``unknown`` when it runs from an uninstalled checkout)."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``lousho``."""
    parser = argparse.ArgumentParser(prog="lousho", description="Durable agent runs on Celery.")
    parser.add_argument("--version", action="version", version=f"lousho {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    runs.add_commands(sub)
    listing.add_commands(sub)
    recordings.add_commands(sub)
    doctor.add_command(sub)
    watch.add_command(sub)
    approvals.add_command(sub)
    schedule_commands.add_cli(sub)
    webhooks.add_command(sub)
    flower.add_command(sub)
    storage.add_command(sub)
    prune.add_command(sub)
    dev.add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``lousho``; returns the exit status (0, or 1 for a Lousho error); a usage error exits 2.

    Raises:
        SystemExit: for ``--help``, ``--version`` (status 0) and usage errors (status 2), as argparse does.
    """
    from store import redaction

    redaction.install()  # before anything can log: every command, and the servers some of them run
    args = build_parser().parse_args(argv)
    try:
        with Client(load_settings()) as client:
            code: int = args.fn(client, args)
            return code
    except errors.LoushoError as exc:
        output.print_error(exc, as_json=getattr(args, "json", False))
        return 1
