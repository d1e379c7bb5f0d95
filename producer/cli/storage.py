"""``lousho storage upgrade``: move the runs still stored in an older checkpoint format to the current one.

The conversion is ``store.upgrade``'s; this prints its report. Safe while workers run; run it once no worker of
the previous release is left.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from producer.cli.output import accept_json, print_json
from producer.client import Client
from store import records
from store.registry import PostgresAgentRegistry
from store.upgrade import upgrade_runs

#: Unreadable runs (and old workers) the text output names (``--json`` gives every run the report names).
_SHOWN = 10
#: A worker registration this recent counts as a live worker (workers refresh theirs every 15 s at most).
LIVE_WITHIN_S = 60.0


def cmd_storage_upgrade(client: Client, args: argparse.Namespace) -> int:
    """``lousho storage upgrade [--batch N]``: convert format-1 runs to the current format and print the counts.

    Refused (exit 1) while a live worker registered without the current format, unless ``--force``.

    Raises:
        StorageError: the database failed (runs converted so far stay converted; run the command again).
    """
    behind = PostgresAgentRegistry(client.engine).not_reading(records.CHECKPOINT_FORMAT, LIVE_WITHIN_S)
    if behind and not args.force:
        named = ", ".join(behind[:_SHOWN]) + (f" and {len(behind) - _SHOWN} more" if len(behind) > _SHOWN else "")
        print(
            f"refused: {len(behind)} live worker(s) do not read checkpoint format {records.CHECKPOINT_FORMAT}"
            f" ({named}); they would write converted runs back in the old format. Upgrade or stop them first,"
            " or pass --force",
            file=sys.stderr,
        )
        return 1
    report = upgrade_runs(client.engine, batch=args.batch)
    if args.json:
        print_json(dataclasses.asdict(report))
        return 0
    print(f"converted {report.converted} run(s) to checkpoint format {records.CHECKPOINT_FORMAT}")
    if report.skipped:
        print(
            f"skipped {report.skipped} run(s) a worker moved meanwhile (its save converts them; run the command"
            " again to catch any that did not save)"
        )
    if report.unreadable:
        names = ", ".join(report.unreadable_runs[:_SHOWN])
        more = report.unreadable - min(len(report.unreadable_runs), _SHOWN)
        tail = f" and {more} more" if more else ""
        print(f"left {report.unreadable} unreadable run(s) as they are: {names}{tail}")
    return 0


def batch_size(value: str) -> int:
    """A ``--batch`` size: a whole number of at least 1 (anything else is a usage error)."""
    try:
        size = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {value!r}") from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {size}")
    return size


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``lousho storage upgrade`` to the ``lousho`` parser."""
    storage = sub.add_parser("storage", help="maintain how runs are stored")
    actions = storage.add_subparsers(dest="action", required=True)
    upgrade = accept_json(
        actions.add_parser(
            "upgrade", help="convert runs still stored in the previous checkpoint format (once no old worker is left)"
        )
    )
    upgrade.add_argument("--batch", type=batch_size, default=200, help="runs read per page (default 200)")
    upgrade.add_argument(
        "--force",
        action="store_true",
        help="convert even while live workers that do not read the current format are registered",
    )
    upgrade.set_defaults(fn=cmd_storage_upgrade)
