"""``lousho migrate|send|pending|resume|abort|steer|history|fork|compare``: the commands about runs.

Each command calls the client and prints through ``producer.cli.output``; none holds rules of its own
beyond checking run ids before they reach the store.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from datetime import UTC
from typing import Any

from pydantic import ValidationError

from producer.cli.output import accept_json, print_json, print_settled
from producer.client import Client
from producer.trajectories import compare_trajectories
from store import errors, records
from store.database import migrate
from store.limits import Limits
from store.records import PendingRun


def cmd_migrate(client: Client, args: argparse.Namespace) -> int:
    """``lousho migrate``: create or upgrade the database schema."""
    migrate(client.settings)
    if args.json:
        print_json({"migrated": True})
    else:
        print("database schema is up to date")
    return 0


def cmd_send(client: Client, args: argparse.Namespace) -> int:
    """``lousho send AGENT MESSAGE --session ID``: queue input, and with ``--wait`` wait for the run to settle.

    Raises:
        ConfigurationError: ``--metadata`` is not a JSON object.
        InputTooLargeError: ``--metadata`` is over 16 KiB as JSON or too deep.
    """
    metadata = _metadata(args.metadata)
    run = client.agent(args.agent).send(args.message, session_id=args.session, metadata=metadata)
    if not args.wait:
        if args.json:
            print_json({"session_id": run.session_id, "input": run.input_number, "queued": True})
        else:
            print(f"queued input {run.input_number} for run {run.session_id}")
        return 0
    return print_settled(run, args)


def cmd_pending(client: Client, args: argparse.Namespace) -> int:
    """``lousho pending``: runs that are interrupted, running, retrying or awaiting approval."""
    runs = _under_leads(client.pending(args.agent))
    if args.json:
        print_json([{**run.model_dump(mode="json"), "lead": run.lead} for run in runs])
        return 0
    if not runs:
        print("no pending runs")
    for run in runs:
        error = run.last_error
        problem = f"  last error {error.code}: {error.message[:160]}" if error else ""
        approval = f"  approval {run.approval_id}" if run.approval_id else ""
        when = run.next_attempt_at.astimezone(UTC) if run.next_attempt_at else None
        retry = f"  next attempt {when:%Y-%m-%d %H:%M:%S}Z" if when else ""
        retry += f" after {run.failures} failure(s) in a row" if when and run.failures else ""
        indent = "  " * records.depth_of(run.session_id)
        print(f"{indent}{run.session_id}  {run.agent}  {run.state}  step {run.step}{approval}{retry}{problem}")
    return 0


def _under_leads(runs: list[PendingRun]) -> list[PendingRun]:
    """``runs`` with each sub-agent's run right after its lead's (a lead not listed: in its own place)."""
    listed = {run.session_id for run in runs}
    children: dict[str, list[PendingRun]] = {}
    tops: list[PendingRun] = []
    for run in runs:
        if run.lead in listed:
            children.setdefault(str(run.lead), []).append(run)
        else:
            tops.append(run)
    ordered: list[PendingRun] = []

    def add(run: PendingRun) -> None:
        ordered.append(run)
        for child in children.get(run.session_id, []):
            add(child)

    for run in tops:
        add(run)
    return ordered


def _metadata(text: str | None) -> dict[str, Any] | None:
    """``--metadata`` parsed: a JSON object (its size and depth are checked by ``send``).

    Raises:
        ConfigurationError: not JSON, or not an object.
        InputTooLargeError: nested too deeply to parse.
    """
    if text is None:
        return None
    try:
        value = json.loads(text)
    except RecursionError:
        raise errors.InputTooLargeError("--metadata is nested too deeply") from None
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise errors.ConfigurationError('--metadata must be a JSON object, such as \'{"plan": "pro"}\'')
    return value


def _limits(args: argparse.Namespace) -> Limits | None:
    """The ``--max-*`` options of ``resume`` as ``Limits``; None when none is given."""
    given = {
        "max_cost": args.max_cost,
        "max_input_tokens": args.max_input_tokens,
        "max_output_tokens": args.max_output_tokens,
        "max_duration_s": args.max_duration,
    }
    if all(value is None for value in given.values()):
        return None
    try:
        return Limits(**given)
    except ValidationError:
        raise errors.ConfigurationError("--max-* limits must be positive numbers") from None


def cmd_resume(client: Client, args: argparse.Namespace) -> int:
    """``lousho resume ID``: finish an interrupted or stopped run (nothing to do is not an error).

    ``--max-cost``, ``--max-input-tokens``, ``--max-output-tokens`` and ``--max-duration`` replace the
    agent's limits for the run (those not given are unlimited), so a budget-stopped run continues.

    Raises:
        ConfigurationError: a limit is not a positive number.
    """
    run = client.resume(args.session, limits=_limits(args))
    if run is None:
        if args.json:
            print_json({"session_id": args.session, "resumed": False})
        else:
            print(f"nothing pending for {args.session}")
        return 0
    if args.wait:
        return print_settled(run, args)
    if args.json:
        print_json({"session_id": args.session, "resumed": True})
    else:
        print(f"resumed {args.session}")
    return 0


def cmd_abort(client: Client, args: argparse.Namespace) -> int:
    """``lousho abort ID``: stop a run at its next safe point (a finished run is left as it is).

    Raises:
        SessionIdInvalidError: the id breaks the id rules.
        CheckpointNotFoundError: no such run.
    """
    session_id = records.validate_session_id(args.session)
    aborting = client.abort(session_id)
    if args.json:
        print_json({"session_id": session_id, "aborting": aborting})
    elif aborting:
        print(
            f"abort requested for {session_id}: it stops at its next safe point and stays resumable "
            f"(lousho resume {session_id}, or a send)"
        )
    else:
        print(f"{session_id} is finished; nothing to abort")
    return 0


def cmd_steer(client: Client, args: argparse.Namespace) -> int:
    """``lousho steer ID MESSAGE``: give a run a message it takes at its next safe point.

    Raises:
        SessionIdInvalidError: the id breaks the id rules.
        CheckpointNotFoundError: no such run.
        SessionAwaitingApprovalError: the run waits on an approval.
    """
    session_id = records.validate_session_id(args.session)
    checkpoint = client.store.load(session_id)
    if checkpoint is None:
        raise errors.CheckpointNotFoundError(f"run {session_id!r} is not stored")
    run = client.agent(checkpoint.agent).steer(session_id, args.message)
    if args.json:
        print_json({"session_id": session_id, "input": run.input_number})
    else:
        print(f"steered {session_id}: input {run.input_number} is taken at its next safe point")
    return 0


def cmd_history(client: Client, args: argparse.Namespace) -> int:
    """``lousho history ID``: the run's saved states, newest first."""
    entries = client.store.history(records.validate_session_id(args.session), args.limit)
    if args.json:
        print_json(
            [
                {
                    "step": e.step,
                    "seq": e.seq,
                    "saved_at": e.saved_at.isoformat(),
                    "status": e.status,
                    "checkpoint": e.checkpoint.model_dump(mode="json", exclude_none=True),
                }
                for e in entries
            ]
        )
        return 0
    if not entries:
        print(f"no history for {args.session}")
    for entry in entries:
        messages = entry.checkpoint.messages
        last = messages[-1].role if messages else "-"
        print(
            f"seq {entry.seq:>4}  step {entry.step:>3}  {entry.status:<17}  {entry.saved_at.isoformat()}"
            f"  {len(messages)} messages, last {last}"
        )
    return 0


def cmd_fork(client: Client, args: argparse.Namespace) -> int:
    """``lousho fork ID --from-step N``: a new run from a saved state of the run (resume it to run it).

    Raises:
        CheckpointNotFoundError: the run is not stored, or the step is not in its history.
    """
    session_id = records.validate_session_id(args.session)
    if args.new_id:
        records.validate_session_id(args.new_id)  # before anything is read
    checkpoint = client.store.load(session_id)
    if checkpoint is None and not client.store.history(session_id, 1):
        raise errors.CheckpointNotFoundError(f"run {session_id!r} is not stored")
    agent = checkpoint.agent if checkpoint else client.store.history(session_id, 1)[0].checkpoint.agent
    patch = {"append_input": args.append_input} if args.append_input else None
    made = client.agent(agent).fork(session_id, args.from_step, patch=patch, new_session_id=args.new_id)
    if args.json:
        print_json(
            {
                "session_id": made.session_id,
                "step": made.step,
                "checkpoint": made.checkpoint.model_dump(mode="json", exclude_none=True),
            }
        )
    else:
        print(
            f"forked {session_id} at step {made.step} as {made.session_id}; run it with: lousho resume "
            f"{made.session_id}"
        )
    return 0


def cmd_compare(client: Client, args: argparse.Namespace) -> int:
    """``lousho compare A B``: where two runs' trajectories diverge, and how.

    Raises:
        CheckpointNotFoundError: one of the runs is not stored.
    """
    runs = []
    for session_id in (records.validate_session_id(args.a), records.validate_session_id(args.b)):
        checkpoint = client.store.load(session_id)
        if checkpoint is None:
            raise errors.CheckpointNotFoundError(f"run {session_id!r} is not stored")
        runs.append(checkpoint)
    comparison = compare_trajectories(runs[0], runs[1])
    if args.json:
        print_json(dataclasses.asdict(comparison))
        return 0
    where = "identical" if comparison.diverged_at is None else f"diverged at step {comparison.diverged_at}"
    print(f"{args.a} ({len(comparison.a)} steps) vs {args.b} ({len(comparison.b)} steps): {where}")
    drift = comparison.drift
    for item in drift.tool_order:
        print(f"  step {item['step']}: tools {item['a']} vs {item['b']}")
    for item in drift.arguments:
        print(f"  step {item['step']}: {item['tool']} arguments {json.dumps(item['a'])} vs {json.dumps(item['b'])}")
    if drift.step_count:
        print(f"  step count {drift.step_count['a']} vs {drift.step_count['b']}")
    if drift.finish_reason:
        print(f"  finish reason {drift.finish_reason['a']} vs {drift.finish_reason['b']}")
    return 0


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the run commands to the ``lousho`` parser."""
    accept_json(sub.add_parser("migrate", help="create or upgrade the database schema")).set_defaults(fn=cmd_migrate)
    send = accept_json(sub.add_parser("send", help="send a message to an agent's run"))
    send.add_argument("agent")
    send.add_argument("message")
    send.add_argument("--session", required=True, help="run id (1-200 of A-Za-z0-9_.-)")
    send.add_argument("--wait", action="store_true", help="wait for the run to settle")
    send.add_argument("--timeout", type=float, default=60.0)
    send.add_argument(
        "--metadata",
        default=None,
        metavar="JSON",
        help="a JSON object sent with the input for the application's code (at most 16 KiB)",
    )
    send.set_defaults(fn=cmd_send)
    pending = accept_json(
        sub.add_parser("pending", help="list runs that are interrupted, running or awaiting approval")
    )
    pending.add_argument("--agent", default=None)
    pending.set_defaults(fn=cmd_pending)
    resume = accept_json(sub.add_parser("resume", help="finish an interrupted run"))
    resume.add_argument("session")
    resume.add_argument("--wait", action="store_true")
    resume.add_argument("--timeout", type=float, default=60.0)
    resume.add_argument("--max-cost", type=float, default=None, help="the run's new cost limit")
    resume.add_argument("--max-input-tokens", type=int, default=None, help="the run's new input-token limit")
    resume.add_argument("--max-output-tokens", type=int, default=None, help="the run's new output-token limit")
    resume.add_argument(
        "--max-duration",
        type=float,
        default=None,
        metavar="SECONDS",
        help="the run's new wall-time limit (pauses excluded)",
    )
    resume.set_defaults(fn=cmd_resume)
    abort = accept_json(sub.add_parser("abort", help="stop a run at its next safe point (it stays resumable)"))
    abort.add_argument("session")
    abort.set_defaults(fn=cmd_abort)
    steer = accept_json(sub.add_parser("steer", help="redirect a run with a message at its next safe point"))
    steer.add_argument("session")
    steer.add_argument("message")
    steer.set_defaults(fn=cmd_steer)
    history = accept_json(sub.add_parser("history", help="show a run's saved states, newest first"))
    history.add_argument("session")
    history.add_argument("--limit", type=int, default=None)
    history.set_defaults(fn=cmd_history)
    fork = accept_json(sub.add_parser("fork", help="start a new run from a step of a run's history"))
    fork.add_argument("session")
    fork.add_argument("--from-step", type=int, required=True)
    fork.add_argument("--append-input", default=None, help="a user message queued after pending calls")
    fork.add_argument("--new-id", default=None, help="the fork's run id (default <id>.fork-<n>)")
    fork.set_defaults(fn=cmd_fork)
    compare = accept_json(sub.add_parser("compare", help="compare two runs step by step"))
    compare.add_argument("a")
    compare.add_argument("b")
    compare.set_defaults(fn=cmd_compare)
