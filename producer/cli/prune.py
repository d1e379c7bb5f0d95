"""``lousho prune``: delete finished runs older than an age with everything kept under their ids, batch by batch.

The rules are ``store.retention``'s (which runs are due, how long delivery ids, body hashes and ticks outlive
them); this runs its batches until nothing is due and prints the counts. Safe while workers and the beat's
retention sweep run: each batch skips the rows another holds.
"""

from __future__ import annotations

import argparse
from datetime import timedelta

from producer.cli.output import accept_json, print_json
from producer.cli.storage import batch_size
from producer.client import Client
from store import errors, retention


def cmd_prune(client: Client, args: argparse.Namespace) -> int:
    """``lousho prune --older-than AGE [--keys-older-than AGE] [--dry-run] [--batch N]``: prune, print the counts.

    Raises:
        ConfigurationError: keys would be kept less long than runs.
        StorageError: the database failed (batches done so far stay done; run the command again).
    """
    older_than: timedelta = args.older_than
    keys_older_than: timedelta | None = args.keys_older_than
    configured = client.settings.retention_keys_days
    if keys_older_than is None and configured is not None:
        keys_older_than = max(timedelta(days=configured), older_than)
    keys_age = retention.keys_age(older_than, keys_older_than)
    if args.dry_run:
        due = retention.count_due(client.engine, older_than, keys_older_than=keys_age)
        if args.json:
            print_json(
                {
                    "dry_run": True,
                    **due.model_dump(include={"runs", "deliveries", "bodies", "ticks"}),
                    "keys_older_than_s": keys_age.total_seconds(),
                }
            )
        else:
            print(
                f"would prune {due.runs} run(s) (sub-agent runs included), and {_keys(due)} older than"
                f" {_days(keys_age)}"
            )
        return 0
    total, batches = retention.PruneResult(), 0
    while True:
        done = retention.prune(client.engine, older_than, args.batch, keys_older_than=keys_age)
        total, batches = total + done, batches + 1
        if not done.more:
            break
    if args.json:
        print_json(
            {
                "dry_run": False,
                **total.model_dump(exclude={"more"}),
                "batches": batches,
                "keys_older_than_s": keys_age.total_seconds(),
            }
        )
        return 0
    print(
        f"pruned {total.runs} run(s) (sub-agent runs included) with {total.history} history entries,"
        f" {total.messages} message rows, {total.events} events and {total.approvals} approvals,"
        f" in {batches} batch(es)"
    )
    print(f"pruned {_keys(total)} older than {_days(keys_age)}")
    return 0


def _keys(counts: retention.PruneResult) -> str:
    return f"{counts.deliveries} delivery id(s), {counts.bodies} body hash(es) and {counts.ticks} schedule tick(s)"


def _days(age: timedelta) -> str:
    return f"{age.total_seconds() / 86_400:g} days"


def _age(value: str) -> timedelta:
    """An ``--older-than`` value (``30d``, ``12h``...); anything else is a usage error."""
    try:
        return retention.parse_age(value)
    except errors.ConfigurationError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``lousho prune`` to the ``lousho`` parser."""
    prune = accept_json(
        sub.add_parser("prune", help="delete finished runs older than an age, with their history, events and approvals")
    )
    prune.add_argument(
        "--older-than",
        type=_age,
        required=True,
        metavar="AGE",
        help="age of the last save of the runs to prune: 30d, 12h, 90m, 2w",
    )
    prune.add_argument(
        "--keys-older-than",
        type=_age,
        metavar="AGE",
        help="age of the webhook delivery ids, GitHub body hashes and schedule ticks to prune (default:"
        " LOUSHO_RETENTION_KEYS_DAYS, else 4 x --older-than and at least 30d; never less than"
        " --older-than)",
    )
    prune.add_argument("--dry-run", action="store_true", help="count what is due, delete nothing")
    prune.add_argument(
        "--batch",
        type=batch_size,
        default=retention.BATCH,
        help=f"runs (and keys of each kind) per batch, one transaction each (default {retention.BATCH})",
    )
    prune.set_defaults(fn=cmd_prune)
