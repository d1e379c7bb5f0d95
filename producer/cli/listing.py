"""``lousho runs|show|delete``: every run listed in its state, one run explained, and a run dropped.

Each command calls the client (``Client.runs``, ``Client.describe``, ``Client.delete``) and prints through
``producer.cli.output``; the words are the runs' one state vocabulary (``docs/reference/states.md``).
"""

from __future__ import annotations

import argparse
import urllib.parse
from datetime import UTC, datetime
from typing import Any

from producer.cli.output import accept_json, print_json
from producer.client import Client
from producer.inspection import parse_since
from store import errors, records
from store.summaries import RunSummary

#: Saved states ``show`` prints, newest first.
SHOW_STEPS = 5


def _names(values: list[str] | None) -> list[str] | None:
    """Repeated or comma-separated names as one list (None when none was given)."""
    if not values:
        return None
    return [name.strip() for value in values for name in value.split(",") if name.strip()]


def _when(value: datetime | None) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ") if value is not None else "-"


def _line(run: RunSummary) -> str:
    """One run on one line: id, agent, state (with its finish reason or error), step, tokens, created."""
    detail = ""
    if run.last_error is not None and run.state in ("parked", "retrying"):
        detail = f" ({run.last_error.code})"
    elif run.finish_reason and run.state in ("finished", "aborted", "budget-exceeded"):
        detail = f" ({run.finish_reason})"
    retry = f"  next attempt {_when(run.next_attempt_at)}" if run.next_attempt_at else ""
    indent = "  " * records.depth_of(run.session_id)
    return (
        f"{indent}{run.session_id}  {run.agent}  {run.state}{detail}  step {run.step}"
        f"  {run.usage.total_tokens} tokens  created {_when(run.created_at)}{retry}"
    )


def cmd_runs(client: Client, args: argparse.Namespace) -> int:
    """``lousho runs``: every run, finished ones included, newest first, in its state.

    Raises:
        ConfigurationError: an unknown state, a bad ``--since``, ``--limit`` out of 1-500, or a cursor no page gave.
    """
    page = client.runs(
        agent=_names(args.agent),
        state=_names(args.state),
        since=parse_since(args.since),
        limit=args.limit,
        cursor=args.cursor,
    )
    if args.json:
        print_json(
            {
                "items": [run.model_dump(mode="json", exclude={"waiting_on", "next_action"}) for run in page.items],
                "next_cursor": page.next_cursor,
                "prev_cursor": page.prev_cursor,
            }
        )
        return 0
    if not page.items:
        print("no runs")
    for run in page.items:
        print(_line(run))
    if page.next_cursor is not None:
        print(f"more: lousho runs --cursor {page.next_cursor}")
    return 0


def _links(client: Client, session_id: str) -> dict[str, str]:
    """Where else to look at the run: its page (``LOUSHO_UI_URL``) and its tasks in Flower (``LOUSHO_FLOWER_URL``)."""
    quoted = urllib.parse.quote(session_id, safe="")
    links = {}
    if client.settings.ui_url:
        links["page"] = f"{client.settings.ui_url.rstrip('/')}/ui/runs/{quoted}"
    if client.settings.flower_url:
        links["flower"] = f"{client.settings.flower_url.rstrip('/')}/tasks?search={quoted}"
    return links


def cmd_show(client: Client, args: argparse.Namespace) -> int:
    """``lousho show RUN``: where a run stands, what it waits on, what moves it next, its last steps and links.

    Raises:
        SessionIdInvalidError: the id breaks the id rules.
        CheckpointNotFoundError: no such run.
    """
    summary = client.describe(args.session)
    if summary is None:
        raise errors.CheckpointNotFoundError(f"run {args.session!r} is not stored")
    steps = [
        {"step": e.step, "seq": e.seq, "status": e.status, "saved_at": e.saved_at.isoformat()}
        for e in client.store.history(summary.session_id, SHOW_STEPS)
    ]
    links = _links(client, summary.session_id)
    if args.json:
        print_json({**summary.model_dump(mode="json"), "last_steps": steps, "links": links})
        return 0
    print(f"{summary.session_id}  {summary.agent}  {summary.state}")
    fields: list[tuple[str, Any]] = [
        ("status", summary.status),
        ("finish reason", summary.finish_reason),
        ("step", summary.step),
        ("usage", f"{summary.usage.input_tokens} in, {summary.usage.output_tokens} out"),
        ("cost", summary.cost),
        ("lead", summary.parent_id),
        (
            "last error",
            f"{summary.last_error.code}: {summary.last_error.message[:200]}" if summary.last_error else None,
        ),
        ("failures", summary.failures or None),
        ("attempts", summary.attempts or None),
        ("next attempt", _when(summary.next_attempt_at) if summary.next_attempt_at else None),
        ("created", _when(summary.created_at)),
        ("updated", _when(summary.updated_at)),
    ]
    for name, value in fields:
        if value is not None:
            print(f"  {name + ':':<15}{value}")
    waiting = summary.waiting_on.model_dump(exclude_defaults=True) if summary.waiting_on else {}
    for name, value in waiting.items():
        shown = ", ".join(value) if isinstance(value, list) else value
        print(f"  waiting on {name.replace('_', ' ')}: {shown}")
    print(f"  next: {summary.next_action}")
    if steps:
        print("  last steps:")
        for entry in steps:
            print(f"    step {entry['step']:>3}  seq {entry['seq']:>4}  {entry['status']:<17}  {entry['saved_at']}")
    for name, url in links.items():
        print(f"  {name}: {url}")
    return 0


def cmd_delete(client: Client, args: argparse.Namespace) -> int:
    """``lousho delete RUN``: drop a run with its children (``--keep-history`` keeps its saved states).

    Raises:
        SessionIdInvalidError: the id breaks the id rules.
        CheckpointNotFoundError: no such run.
    """
    if not client.delete(args.session, keep_history=args.keep_history):
        raise errors.CheckpointNotFoundError(f"run {args.session!r} is not stored")
    if args.json:
        print_json({"session_id": args.session, "deleted": True})
    else:
        print(f"deleted {args.session}")
    return 0


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``runs``, ``show`` and ``delete`` to the ``lousho`` parser."""
    listed = accept_json(sub.add_parser("runs", help="list runs, finished ones included, newest first"))
    listed.add_argument("--agent", action="append", help="only this agent's runs (repeat, or a,b)")
    listed.add_argument(
        "--state", action="append", help=f"only runs in this state (repeat, or a,b): {', '.join(records.LISTED_STATES)}"
    )
    listed.add_argument("--since", default=None, help="only runs created since: 30m, 6h, 2d, or an ISO-8601 time")
    listed.add_argument("--limit", type=int, default=50, help="most runs listed (1-500)")
    listed.add_argument("--cursor", default=None, help="the page after the one that printed it")
    listed.set_defaults(fn=cmd_runs)
    show = accept_json(sub.add_parser("show", help="where a run stands, what it waits on, and what moves it next"))
    show.add_argument("session")
    show.set_defaults(fn=cmd_show)
    delete = accept_json(sub.add_parser("delete", help="delete a run and its sub-agents' runs"))
    delete.add_argument("session")
    delete.add_argument("--keep-history", action="store_true", help="keep its saved states (history, fork)")
    delete.set_defaults(fn=cmd_delete)


__all__ = ["SHOW_STEPS", "add_commands", "cmd_delete", "cmd_runs", "cmd_show"]
