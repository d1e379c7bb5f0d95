"""``lousho schedules create|list|pause|resume|delete|fires``: the command line of ``client.schedules``.

Prints what the client returns; the rules (timing, input, known agents) are the client's and the store's.
"""

from __future__ import annotations

import argparse
from typing import Any

from producer.cli import output
from producer.client import Client
from store import errors
from store.schedule_records import Schedule


def _say(args: argparse.Namespace, value: Any, text: str) -> None:
    if args.json:
        output.print_json(value)
    else:
        print(text)


def _line(schedule: Schedule) -> str:
    timing = f"cron {schedule.cron!r} {schedule.timezone}" if schedule.cron else f"every {schedule.every_s}s"
    state = "paused" if schedule.paused else f"next {schedule.next_fire_at.isoformat()}"
    if schedule.broken_error is not None:
        since = schedule.broken_at.isoformat() if schedule.broken_at else "?"
        state = f"BROKEN since {since}: {schedule.broken_error}" + ("  (paused)" if schedule.paused else "")
    return (
        f"{schedule.name}  {schedule.agent}  {timing}  overlap={schedule.overlap}  catch_up={schedule.catch_up}"
        f"  {state}"
    )


def _dump(schedule: Schedule) -> dict[str, Any]:
    # The broken fields are always present (null when healthy) so a script can filter on them.
    return {
        **schedule.model_dump(mode="json", exclude_none=True),
        **schedule.model_dump(mode="json", include={"broken_error", "broken_at"}),
    }


def cmd_schedules(client: Client, args: argparse.Namespace) -> int:
    """Run ``lousho schedules <action>``."""
    schedules = client.schedules
    if args.action == "create":
        if args.every is None and args.cron is None:
            raise errors.ConfigurationError("schedules create needs --cron or --every")
        made = schedules.create(
            args.name,
            args.agent,
            args.input,
            cron=args.cron,
            every=args.every,
            timezone=args.timezone,
            overlap=args.overlap,
            catch_up=args.catch_up,
        )
        _say(args, _dump(made), f"created {_line(made)}")
        return 0
    if args.action == "list":
        found = schedules.list()
        if args.json:
            output.print_json([_dump(s) for s in found])
        else:
            print("\n".join(_line(s) for s in found) or "no schedules")
            broken = [s.name for s in found if s.broken_error is not None]
            if broken:
                print(
                    f"{len(broken)} broken (not firing): {', '.join(broken)}; fix the timing and redefine,"
                    " or `lousho schedules resume NAME` once the workers can compute it"
                )
        return 0
    if args.action == "fires":
        fires = schedules.fires(args.name, args.limit)
        if args.json:
            output.print_json([f.model_dump(mode="json") for f in fires])
        else:
            print(
                "\n".join(f"{f.fire_at.isoformat()}  {f.outcome}  {f.session_id or '-'}" for f in fires)
                or "no ticks fired yet"
            )
        return 0
    if args.action == "delete":
        deleted = schedules.delete(args.name)
        _say(
            args,
            {"name": args.name, "deleted": deleted},
            f"deleted {args.name}" if deleted else f"no schedule named {args.name}",
        )
        return 0 if deleted else 1
    changed = schedules.pause(args.name) if args.action == "pause" else schedules.resume(args.name)
    _say(args, _dump(changed), f"{args.action}d {_line(changed)}")
    return 0


def add_cli(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``lousho schedules create|list|pause|resume|delete|fires`` to the ``lousho`` parser."""
    parser = subparsers.add_parser("schedules", help="create, list, pause, resume or delete schedules")
    actions = parser.add_subparsers(dest="action", required=True)

    def action(name: str, help_text: str) -> argparse.ArgumentParser:
        sp = output.accept_json(actions.add_parser(name, help=help_text))
        sp.set_defaults(fn=cmd_schedules)
        return sp

    create = action("create", "store a schedule (one of --cron or --every)")
    create.add_argument("name")
    create.add_argument("agent")
    create.add_argument("input", help="the user message each tick's run starts with")
    timing = create.add_mutually_exclusive_group(required=True)
    timing.add_argument("--cron", default=None, help="5-field cron expression or @daily/@hourly/...")
    timing.add_argument("--every", type=int, default=None, help="interval in whole seconds (1 to 10 years)")
    create.add_argument("--timezone", default="UTC", help="IANA zone the cron expression is read in")
    create.add_argument("--overlap", choices=["skip", "allow"], default="skip")
    create.add_argument("--catch-up", dest="catch_up", choices=["skip", "one"], default="one")
    action("list", "list schedules")
    for name, text in (
        ("pause", "stop firing a schedule"),
        ("resume", "fire a paused schedule again, or try a broken one again"),
        ("delete", "delete a schedule (its runs stay)"),
    ):
        action(name, text).add_argument("name")
    fires = action("fires", "show a schedule's claimed ticks, newest first")
    fires.add_argument("name")
    fires.add_argument("--limit", type=int, default=20)
