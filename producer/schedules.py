"""Schedules from the producer side: ``client.schedules`` (create/list/pause/resume/delete), ``lousho schedules``.

Owns argument checking and the command line. It must not fire ticks: the beat sweep in
``worker.schedules`` does; the records are ``store.schedule_records``, the tick arithmetic ``store.ticks``.
"""

from __future__ import annotations

import argparse
import builtins
import json
from datetime import timedelta
from typing import Any, Protocol

from store import errors, inputs
from store.checkpoints import PostgresCheckpointStore
from store.schedule_records import CatchUp, Fire, Overlap, Schedule, build_spec
from store.schedules import PostgresScheduleStore


class Producer(Protocol):
    """What schedules need of ``producer.client.Client`` (typed here so neither module imports the other)."""

    @property
    def store(self) -> PostgresCheckpointStore:
        """The checkpoint store."""

    def known_agents(self) -> list[str]:
        """Agents registered by workers."""


class Schedules:
    """Schedules stored in Postgres; every beat fires each of their ticks once."""

    def __init__(self, client: Producer) -> None:
        self._client = client
        self._store = PostgresScheduleStore(client.store.engine)

    def create(self, name: str, agent: str, input: inputs.Input, *, cron: str | None = None,
               every: float | timedelta | None = None, timezone: str = "UTC", overlap: Overlap = "skip",
               catch_up: CatchUp = "one", check_agent: bool = True) -> Schedule:
        """Store a schedule that sends ``input`` to a new run of ``agent`` at each tick.

        Give ``cron`` (5 fields or a ``@daily``-style macro, read in ``timezone``, DST-aware) or
        ``every`` (whole seconds or a ``timedelta``, 1 s to 10 years; ticks aligned on the Unix epoch). Each tick's
        run is ``sched-<schedule_id>-<UTC time>``. ``overlap="skip"`` claims a tick without a run
        while the previous run is active (not while it is parked on a non-retryable error);
        ``catch_up="one"`` fires one run for ticks missed during downtime (older than the sweep's
        grace), ``"skip"`` drops them.

        Raises:
            ConfigurationError: an invalid field (its ``field`` names it: an unknown time zone, a cron
                expression that does not parse, ``every`` outside 1 s to 10 years), both or neither of
                cron/every, or the name is taken.
            InputTooLargeError: the input is too large or too deep.
            AgentNotFoundError: workers registered agents and this name is not among them.
        """
        messages = inputs.normalize_input(input)
        if check_agent:
            inputs.check_agent(agent, self._client.known_agents())
        spec = build_spec(name, agent, messages, cron=cron, every=every, timezone=timezone, overlap=overlap,
                          catch_up=catch_up)
        return self._store.create(spec)

    def list(self) -> builtins.list[Schedule]:
        """Every schedule, by name; a broken one has ``broken_error`` and ``broken_at`` set."""
        return self._store.list()

    def get(self, name: str) -> Schedule:
        """One schedule.

        Raises:
            ScheduleNotFoundError: no schedule has that name.
        """
        return self._store.get(name)

    def pause(self, name: str) -> Schedule:
        """Stop firing until ``resume``.

        Raises:
            ScheduleNotFoundError: no schedule has that name.
        """
        return self._store.pause(name)

    def resume(self, name: str) -> Schedule:
        """Fire again from the next tick after now; ticks of the pause are not fired.

        Also tries a broken schedule again (once the workers can compute its ticks): it stays
        broken, with the new error, when its ticks still cannot be computed here.

        Raises:
            ScheduleNotFoundError: no schedule has that name.
        """
        return self._store.resume(name)

    def delete(self, name: str) -> bool:
        """Drop the schedule (its runs stay); False when there is none of that name."""
        return self._store.delete(name)

    def fires(self, name: str, limit: int = 20) -> builtins.list[Fire]:
        """The schedule's claimed ticks, newest first."""
        return self._store.fires(name, limit)


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, default=str))


def _say(args: argparse.Namespace, value: Any, text: str) -> None:
    if args.json:
        _print_json(value)
    else:
        print(text)


def _line(schedule: Schedule) -> str:
    timing = f"cron {schedule.cron!r} {schedule.timezone}" if schedule.cron else f"every {schedule.every_s}s"
    state = "paused" if schedule.paused else f"next {schedule.next_fire_at.isoformat()}"
    if schedule.broken_error is not None:
        since = schedule.broken_at.isoformat() if schedule.broken_at else "?"
        state = f"BROKEN since {since}: {schedule.broken_error}" + ("  (paused)" if schedule.paused else "")
    return (f"{schedule.name}  {schedule.agent}  {timing}  overlap={schedule.overlap}  catch_up={schedule.catch_up}"
            f"  {state}")


def _dump(schedule: Schedule) -> dict[str, Any]:
    # The broken fields are always present (null when healthy) so a script can filter on them.
    return {**schedule.model_dump(mode="json", exclude_none=True),
            **schedule.model_dump(mode="json", include={"broken_error", "broken_at"})}


def cmd_schedules(client: Producer, args: argparse.Namespace) -> int:
    """Run ``lousho schedules <action>``."""
    schedules = Schedules(client)
    if args.action == "create":
        if args.every is None and args.cron is None:
            raise errors.ConfigurationError("schedules create needs --cron or --every")
        made = schedules.create(args.name, args.agent, args.input, cron=args.cron, every=args.every,
                                timezone=args.timezone, overlap=args.overlap, catch_up=args.catch_up)
        _say(args, _dump(made), f"created {_line(made)}")
        return 0
    if args.action == "list":
        found = schedules.list()
        if args.json:
            _print_json([_dump(s) for s in found])
        else:
            print("\n".join(_line(s) for s in found) or "no schedules")
            broken = [s.name for s in found if s.broken_error is not None]
            if broken:
                print(f"{len(broken)} broken (not firing): {', '.join(broken)}; fix the timing and redefine,"
                      " or `lousho schedules resume NAME` once the workers can compute it")
        return 0
    if args.action == "fires":
        fires = schedules.fires(args.name, args.limit)
        if args.json:
            _print_json([f.model_dump(mode="json") for f in fires])
        else:
            print("\n".join(f"{f.fire_at.isoformat()}  {f.outcome}  {f.session_id or '-'}" for f in fires)
                  or "no ticks fired yet")
        return 0
    if args.action == "delete":
        deleted = schedules.delete(args.name)
        _say(args, {"name": args.name, "deleted": deleted},
             f"deleted {args.name}" if deleted else f"no schedule named {args.name}")
        return 0 if deleted else 1
    changed = schedules.pause(args.name) if args.action == "pause" else schedules.resume(args.name)
    _say(args, _dump(changed), f"{args.action}d {_line(changed)}")
    return 0


def add_cli(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``lousho schedules create|list|pause|resume|delete|fires`` to the ``lousho`` parser."""
    parser = subparsers.add_parser("schedules", help="create, list, pause, resume or delete schedules")
    actions = parser.add_subparsers(dest="action", required=True)

    def action(name: str, help_text: str) -> argparse.ArgumentParser:
        sp = actions.add_parser(name, help=help_text)
        sp.add_argument("--json", action="store_true", help="print JSON")
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
    for name, text in (("pause", "stop firing a schedule"),
                       ("resume", "fire a paused schedule again, or try a broken one again"),
                       ("delete", "delete a schedule (its runs stay)")):
        action(name, text).add_argument("name")
    fires = action("fires", "show a schedule's claimed ticks, newest first")
    fires.add_argument("name")
    fires.add_argument("--limit", type=int, default=20)
