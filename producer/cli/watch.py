"""``lousho watch``: a run printed as it happens, continued after Ctrl-C without printing anything twice.

Owns the small file that remembers, per run, the last seq a watch printed, Ctrl-C, and when to stop: at the end of
the input (past a pause that was decided since, to the input's real end), or never with ``--follow``. The events
come from ``Client.events`` and are printed by ``output.EventPrinter``. It never changes a run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any

from producer.cli.output import EventPrinter, accept_json
from producer.client import Client
from store import errors, records
from store.approvals import PostgresApprovalStore
from store.events import Event

#: Where positions are kept instead of ``$XDG_STATE_HOME/lousho/watch`` (``~/.local/state/lousho/watch``).
STATE_DIR_VARIABLE = "LOUSHO_WATCH_STATE_DIR"
#: The exit status after Ctrl-C (128 + SIGINT, what shells report).
INTERRUPTED = 130


def state_dir() -> Path:
    """The directory of the watch positions: ``$LOUSHO_WATCH_STATE_DIR``, else under the XDG state home."""
    override = os.environ.get(STATE_DIR_VARIABLE)
    if override:
        return Path(override)
    base = os.environ.get("XDG_STATE_HOME", "")
    return (Path(base) if os.path.isabs(base) else Path.home() / ".local" / "state") / "lousho" / "watch"


class Position:
    """The last durable event a watch of one run printed (its seq and time), in ``<state dir>/<run id>.json``."""

    def __init__(self, session_id: str) -> None:
        self.path = state_dir() / f"{session_id}.json"

    def load(self) -> tuple[int, datetime] | None:
        """The saved ``(seq, at)``, or None when there is none (or it cannot be read)."""
        try:
            saved = json.loads(self.path.read_text(encoding="utf-8"))
            seq, at = saved["seq"], datetime.fromisoformat(saved["at"])
        except (OSError, ValueError, TypeError, KeyError):
            return None
        return (seq, at) if isinstance(seq, int) and seq >= 0 else None

    def save(self, event: Event) -> None:
        """Remember ``event`` as the last printed (written whole or not at all)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        partial.write_text(json.dumps({"seq": event.seq, "at": event.at.isoformat()}), encoding="utf-8")
        os.replace(partial, self.path)

    def clear(self) -> None:
        """Forget the position (the watch saw its run settle)."""
        self.path.unlink(missing_ok=True)


def _resume_after(client: Client, session_id: str, position: Position) -> int | None:
    """The saved seq, when the run still has that event; else None (the run's latest input)."""
    saved = position.load()
    if saved is None:
        return None
    seq, at = saved
    found = client.read_events(session_id, seq - 1, limit=1)
    if found and found[0].seq == seq and found[0].at == at:
        return seq
    # The run was deleted and started again under the same id: the saved seq means nothing now.
    print(
        f"the saved position of {session_id} no longer matches the run; starting at its latest input", file=sys.stderr
    )
    position.clear()
    return None


class _Interrupts:
    """Holds Ctrl-C back while an event is printed and its seq saved, so a printed event is always remembered.

    Only the main thread can take signals; elsewhere Ctrl-C is never deferred.
    """

    def __init__(self) -> None:
        self._holding = self._pending = self._installed = False
        self._previous: Any = None

    def __enter__(self) -> _Interrupts:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_interrupt)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)

    def _on_interrupt(self, signum: int, frame: FrameType | None) -> None:
        if self._holding:
            self._pending = True
            return
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Defer Ctrl-C until the block ends, then raise it."""
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
        if self._pending:
            self._pending = False
            raise KeyboardInterrupt


def cmd_watch(client: Client, args: argparse.Namespace) -> int:
    """``lousho watch ID``: print the run's events as they come, until its input settles (exit 0) or Ctrl-C (130).

    Starts after ``--after``, else after the last seq a watch of this run printed, else at the run's latest
    input. A pause whose approvals were all decided is not where the input settles: the watch goes on to the
    input's end. ``--follow`` goes on after that too, through every later input, until Ctrl-C or the run is
    deleted. A watch that saw its run settle forgets its position, so the next one starts at the latest input.

    Raises:
        SessionIdInvalidError: the id breaks the id rules.
        CheckpointNotFoundError: no such run (or it was deleted while followed).
    """
    session_id = records.validate_session_id(args.session)
    if client.store.progress(session_id) is None:
        raise errors.CheckpointNotFoundError(f"run {session_id!r} is not stored")
    position = Position(session_id)
    start = args.after if args.after is not None else _resume_after(client, session_id, position)
    decided = _decided_reader(client)
    printer = EventPrinter(sys.stdout, decided)
    after, last = start, None
    with _Interrupts() as interrupts:
        try:
            while True:
                done = _print_to_run_done(client, session_id, after, args, printer, position, interrupts)
                if done is None:
                    break
                after = last = done.seq
                if not (args.follow or _decided_pause(done, decided)):
                    position.clear()
                    break
        except KeyboardInterrupt:
            printer.end_stream()
            sys.stdout.flush()
            print(
                _stopped(session_id, last if last is not None else position_seq(position), start, args.after),
                file=sys.stderr,
            )
            return INTERRUPTED
    return 0


def _print_to_run_done(
    client: Client,
    session_id: str,
    after: int | None,
    args: argparse.Namespace,
    printer: EventPrinter,
    position: Position,
    interrupts: _Interrupts,
) -> Event | None:
    """Print the events after ``after`` up to the next ``run.done`` (returned), saving the position of each."""
    for event in client.events(session_id, after, live=args.live):
        with interrupts.held():
            _print(event, printer, args.json)
            if event.seq is not None:
                position.save(event)
        if event.type == "run.done":
            return event
    return None


def _decided_reader(client: Client) -> Callable[[Sequence[str]], dict[str, str]]:
    """Which of some approvals were decided (approval id -> status), read from Postgres when asked."""
    store = PostgresApprovalStore(client.engine)

    def decided(approval_ids: Sequence[str]) -> dict[str, str]:
        found = store.by_ids(list(approval_ids))
        return {approval_id: approval.status for approval_id, approval in found.items() if approval.status != "pending"}

    return decided


def _decided_pause(done: Event, decided: Callable[[Sequence[str]], dict[str, str]]) -> bool:
    """Whether ``done`` ended the input at a pause whose approvals were all decided since (the input goes on)."""
    ids = [str(approval_id) for approval_id in done.data.get("approval_ids") or []]
    if done.data.get("finish_reason") != "awaiting-approval" or not ids:
        return False
    return set(ids) <= set(decided(ids))


def position_seq(position: Position) -> int | None:
    """The seq the saved position names, if any."""
    saved = position.load()
    return saved[0] if saved is not None else None


def _print(event: Event, printer: EventPrinter, as_json: bool) -> None:
    if as_json:
        print(json.dumps(event.wire(), ensure_ascii=False), flush=True)
    else:
        printer.show(event)


def _stopped(session_id: str, last: int | None, after: int | None, given: int | None) -> str:
    if last is None and given is not None:
        return f'stopped at seq {given}; run "lousho watch {session_id} --after {given}" to continue'
    seq = last if last is not None else after
    where = f"at seq {seq}" if seq is not None else "before the first event"
    return f'stopped {where}; run "lousho watch {session_id}" to continue'


def _seq(value: str) -> int:
    try:
        seq = int(value)
    except ValueError:
        seq = -2
    if seq < -1:
        raise argparse.ArgumentTypeError(f"not an event seq: {value!r} (an integer from -1)")
    return seq


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``lousho watch`` to the ``lousho`` parser."""
    watch = accept_json(sub.add_parser("watch", help="print a run as it happens (Ctrl-C, then run again to continue)"))
    watch.add_argument("session")
    watch.add_argument(
        "--after",
        type=_seq,
        default=None,
        help="start after this event seq (default: where the last watch stopped, else the latest input)",
    )
    watch.add_argument(
        "--live",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="show model text as it streams and tools as they start (default: on)",
    )
    watch.add_argument(
        "--follow",
        action="store_true",
        help="keep following the run's later inputs, until Ctrl-C or the run is deleted (default: "
        "stop at the end of the input, past a pause that was decided since)",
    )
    watch.set_defaults(fn=cmd_watch)
