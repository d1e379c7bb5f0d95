"""The ``lousho`` command: migrate the database, send, list pending runs, resume, show history.

Every listing prints JSON with ``--json``. Errors print their stable code and exit non-zero.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from datetime import UTC
from typing import Any

from producer import schedules as schedule_commands
from producer.client import Client, Run, RunResult
from producer.trajectories import compare_trajectories
from store import errors
from store.database import migrate
from store.settings import load_settings


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, default=str))


def _result_dict(result: RunResult) -> dict[str, Any]:
    return result.model_dump(mode="json", exclude_none=True)


def _print_settled(run: Run, args: argparse.Namespace, prefix: str = "") -> int:
    """Wait for ``run`` and print how it settled (``--json`` or a line plus the final text)."""
    result = run.wait(timeout=args.timeout)
    if args.json:
        _print_json(_result_dict(result))
    else:
        print(f"{prefix}{result.session_id}: {result.finish_reason} after {result.steps} step(s)")
        if result.text:
            print(result.text)
    return 0


def cmd_migrate(client: Client, args: argparse.Namespace) -> int:
    migrate(client.settings)
    if args.json:
        _print_json({"migrated": True})
    else:
        print("database schema is up to date")
    return 0


def cmd_send(client: Client, args: argparse.Namespace) -> int:
    run = client.agent(args.agent).send(args.message, session_id=args.session)
    if not args.wait:
        if args.json:
            _print_json({"session_id": run.session_id, "input": run.input_number, "queued": True})
        else:
            print(f"queued input {run.input_number} for run {run.session_id}")
        return 0
    return _print_settled(run, args)


def cmd_pending(client: Client, args: argparse.Namespace) -> int:
    runs = client.pending(args.agent)
    if args.json:
        _print_json([run.model_dump(mode="json") for run in runs])
        return 0
    if not runs:
        print("no pending runs")
    for run in runs:
        error = run.last_error
        problem = f"  last error {error.code}: {error.message[:160]}" if error else ""
        approval = f"  approval {run.approval_id}" if run.approval_id else ""
        when = run.next_attempt_at.astimezone(UTC) if run.next_attempt_at else None
        retry = f"  next attempt {when:%Y-%m-%d %H:%M:%S}Z" if when else ""
        print(f"{run.session_id}  {run.agent}  {run.state}  step {run.step}{approval}{retry}{problem}")
    return 0


def cmd_resume(client: Client, args: argparse.Namespace) -> int:
    run = client.resume(args.session)
    if run is None:
        if args.json:
            _print_json({"session_id": args.session, "resumed": False})
        else:
            print(f"nothing pending for {args.session}")
        return 0
    if args.wait:
        return _print_settled(run, args)
    if args.json:
        _print_json({"session_id": args.session, "resumed": True})
    else:
        print(f"resumed {args.session}")
    return 0


def cmd_history(client: Client, args: argparse.Namespace) -> int:
    entries = client.store.history(args.session, args.limit)
    if args.json:
        _print_json([{"step": e.step, "seq": e.seq, "saved_at": e.saved_at.isoformat(), "status": e.status,
                      "checkpoint": e.checkpoint.model_dump(mode="json", exclude_none=True)} for e in entries])
        return 0
    if not entries:
        print(f"no history for {args.session}")
    for entry in entries:
        messages = entry.checkpoint.messages
        last = messages[-1].role if messages else "-"
        print(f"seq {entry.seq:>4}  step {entry.step:>3}  {entry.status:<17}  {entry.saved_at.isoformat()}"
              f"  {len(messages)} messages, last {last}")
    return 0


def cmd_approvals(client: Client, args: argparse.Namespace) -> int:
    approvals = client.agent(args.agent).approvals if args.agent else client.approvals
    if args.action == "list":
        pending = approvals.list()
        if args.json:
            _print_json([a.model_dump(mode="json", exclude={"fingerprint"}) for a in pending])
            return 0
        if not pending:
            print("no pending approvals")
        for a in pending:
            created = a.created_at.isoformat() if a.created_at else "-"
            print(f"{a.approval_id}  {a.agent}  {a.session_id}  {a.tool_name}({json.dumps(a.args)})"
                  f"  call {a.tool_call_id}  since {created}")
        return 0
    if not args.approval_id:
        raise errors.ConfigurationError(f"approvals {args.action} needs an approval id")
    run = approvals.resolve(args.approval_id, approved=args.action == "approve", note=args.note)
    decision = "approved" if args.action == "approve" else "rejected"
    if args.wait:
        return _print_settled(run, args, prefix=f"{decision} {args.approval_id}; ")
    if args.json:
        _print_json({"approval_id": args.approval_id, "decision": decision, "session_id": run.session_id})
    else:
        print(f"{decision} {args.approval_id} (run {run.session_id})")
    return 0


def cmd_fork(client: Client, args: argparse.Namespace) -> int:
    checkpoint = client.store.load(args.session)
    if checkpoint is None and not client.store.history(args.session, 1):
        raise errors.CheckpointNotFoundError(f"run {args.session!r} is not stored")
    agent = checkpoint.agent if checkpoint else client.store.history(args.session, 1)[0].checkpoint.agent
    patch = {"append_input": args.append_input} if args.append_input else None
    made = client.agent(agent).fork(args.session, args.from_step, patch=patch, new_session_id=args.new_id)
    if args.json:
        _print_json({"session_id": made.session_id, "step": made.step,
                     "checkpoint": made.checkpoint.model_dump(mode="json", exclude_none=True)})
    else:
        print(f"forked {args.session} at step {made.step} as {made.session_id}; run it with: lousho resume "
              f"{made.session_id}")
    return 0


def cmd_compare(client: Client, args: argparse.Namespace) -> int:
    runs = []
    for session_id in (args.a, args.b):
        checkpoint = client.store.load(session_id)
        if checkpoint is None:
            raise errors.CheckpointNotFoundError(f"run {session_id!r} is not stored")
        runs.append(checkpoint)
    comparison = compare_trajectories(runs[0], runs[1])
    if args.json:
        _print_json(dataclasses.asdict(comparison))
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


def cmd_webhooks_serve(client: Client, args: argparse.Namespace) -> int:
    from producer.webhooks import cmd_serve  # FastAPI loads only for this command

    return cmd_serve(client, args)


def cmd_demo(client: Client, args: argparse.Namespace) -> int:
    from devkit.demo import run_demo
    from devkit.devserver import dev_services
    from devkit.embedded import EmbeddedError

    try:
        with dev_services() as settings:  # the configured services, else embedded ones for the demo
            return run_demo(settings)
    except EmbeddedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def cmd_dev(client: Client, args: argparse.Namespace) -> int:
    from devkit.devserver import run_dev, stop_services
    from devkit.embedded import EmbeddedError

    try:
        if args.stop:
            stop_services()
            print("stopped the embedded PostgreSQL and Redis")
            return 0
        return run_dev(None, concurrency=args.concurrency, flower=args.flower, flower_port=args.flower_port,
                       keep_services=args.keep_services)
    except EmbeddedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``lousho``."""
    parser = argparse.ArgumentParser(prog="lousho", description="Durable agent runs on Celery.")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_text)
        sp.add_argument("--json", action="store_true", help="print JSON")
        return sp

    command("migrate", "create or upgrade the database schema").set_defaults(fn=cmd_migrate)
    send = command("send", "send a message to an agent's run")
    send.add_argument("agent")
    send.add_argument("message")
    send.add_argument("--session", required=True, help="run id (1-200 of A-Za-z0-9_.-)")
    send.add_argument("--wait", action="store_true", help="wait for the run to settle")
    send.add_argument("--timeout", type=float, default=60.0)
    send.set_defaults(fn=cmd_send)
    pending = command("pending", "list runs that are interrupted, running or awaiting approval")
    pending.add_argument("--agent", default=None)
    pending.set_defaults(fn=cmd_pending)
    resume = command("resume", "finish an interrupted run")
    resume.add_argument("session")
    resume.add_argument("--wait", action="store_true")
    resume.add_argument("--timeout", type=float, default=60.0)
    resume.set_defaults(fn=cmd_resume)
    history = command("history", "show a run's saved states, newest first")
    history.add_argument("session")
    history.add_argument("--limit", type=int, default=None)
    history.set_defaults(fn=cmd_history)
    fork = command("fork", "start a new run from a step of a run's history")
    fork.add_argument("session")
    fork.add_argument("--from-step", type=int, required=True)
    fork.add_argument("--append-input", default=None, help="a user message queued after pending calls")
    fork.add_argument("--new-id", default=None, help="the fork's run id (default <id>.fork-<n>)")
    fork.set_defaults(fn=cmd_fork)
    compare = command("compare", "compare two runs step by step")
    compare.add_argument("a")
    compare.add_argument("b")
    compare.set_defaults(fn=cmd_compare)
    approvals = command("approvals", "list, approve or reject gated tool calls")
    approvals.add_argument("action", choices=["list", "approve", "reject"])
    approvals.add_argument("approval_id", nargs="?")
    approvals.add_argument("--note", default=None, help="a note for the model (with approve/reject)")
    approvals.add_argument("--agent", default=None)
    approvals.add_argument("--wait", action="store_true", help="wait for the run to settle again")
    approvals.add_argument("--timeout", type=float, default=60.0)
    approvals.set_defaults(fn=cmd_approvals)
    schedule_commands.add_cli(sub)
    webhooks = sub.add_parser("webhooks", help="receive signed webhooks that start runs")
    actions = webhooks.add_subparsers(dest="action", required=True)
    serve = actions.add_parser("serve", help="serve POST /webhooks/{agent}, GET /runs/{id}, POST /approvals/{id}")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    serve.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    serve.set_defaults(fn=cmd_webhooks_serve)
    command("demo", "show a run surviving a killed worker").set_defaults(fn=cmd_demo)
    dev = command("dev", "run a worker and beat in the foreground, on embedded Postgres and Redis unless "
                         "LOUSHO_DATABASE_URL / LOUSHO_REDIS_URL are set (Ctrl-C stops everything)")
    dev.add_argument("--concurrency", type=int, default=2, help="worker processes")
    dev.add_argument("--flower", action="store_true", help="also run Flower on 127.0.0.1 (needs flower)")
    dev.add_argument("--flower-port", type=int, default=5555)
    dev.add_argument("--keep-services", action="store_true", help="leave the embedded servers running on exit")
    dev.add_argument("--stop", action="store_true", help="stop embedded servers left running, then exit")
    dev.set_defaults(fn=cmd_dev)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``lousho``; returns the exit status (1 for a Lousho error, 2 for usage)."""
    from store import redaction

    redaction.install()  # before anything can log: every command, and the servers some of them run
    args = build_parser().parse_args(argv)
    try:
        with Client(load_settings()) as client:
            code: int = args.fn(client, args)
            return code
    except errors.LoushoError as exc:
        message = redaction.redact(exc.message)
        if getattr(args, "json", False):
            _print_json({"error": {"code": exc.code, "message": message, "retryable": exc.retryable}})
        else:
            print(f"error {exc.code}: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
