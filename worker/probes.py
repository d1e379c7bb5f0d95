"""Probes a container orchestrator runs: the worker's consumer heartbeat and the database schema gate.

Owns the heartbeat file, touched by the worker's parent from its consumer's event loop while that consumer
consumes, and the ``python -m worker.probes check|schema`` commands that Kubernetes runs. Imports no Celery:
``worker.tasks`` hands over the consumer Celery's ``worker_ready`` signal sends, read here through its attributes.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from store import errors
from store.settings import Settings, load_settings

log = logging.getLogger("lousho.probes")

#: Seconds between two looks at the consumer (and touches of the file while it consumes).
INTERVAL_S = 10.0
#: How long task messages may wait in the worker's queues, while a pool process is free and no message
#: arrives, before the worker counts as not consuming.
STALL_S = 60.0
#: ``check``'s default ``--max-age``: well above ``INTERVAL_S``, so one late tick is not a failure.
MAX_AGE_S = 60.0
#: Seconds between two looks at the schema while ``schema --wait`` waits.
SCHEMA_POLL_S = 2.0


@dataclass(frozen=True)
class ConsumerState:
    """What the heartbeat reads of the consumer at one tick."""

    #: The consumer holds a live broker connection.
    connected: bool
    #: Pool processes minus the task messages the worker holds (running, waiting for a process, or for an ETA).
    free_slots: int
    #: Messages ready in the queues the consumer reads; called only when a free slot makes it matter.
    waiting: Callable[[], int]


class Heartbeat:
    """The heartbeat file and the rule that decides whether the consumer still consumes.

    Ticks come from the consumer's event loop (``watch``), so a loop that is blocked, or busy reconnecting to
    the broker, stops them: the file grows old. At a tick the file is touched unless the consumer has no broker
    connection, or messages have waited in its queues for ``stall_s`` while a pool process was free and none
    arrived (Celery consumers that silently stopped reading after a Redis restart, RELIABILITY P6). A busy
    worker, or an idle one with empty queues, is consuming.
    """

    def __init__(self, path: Path, *, stall_s: float = STALL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._stall_s = stall_s
        self._clock = clock
        self._last_received = -math.inf
        self._stalled_since: float | None = None
        self._consuming = True

    def received(self) -> None:
        """A task message reached the worker (Celery's ``task_received``)."""
        self._last_received = self._clock()

    def beat(self, state: ConsumerState) -> bool:
        """Touch the file when the consumer consumes; whether it was touched."""
        reason = self._stop_reason(state)
        if reason is not None:
            if self._consuming:
                log.warning("the liveness heartbeat stopped: %s", reason)
            self._consuming = False
            return False
        if not self._consuming:
            log.info("the liveness heartbeat resumed: the consumer consumes again")
        self._consuming = True
        return self.touch()

    def touch(self) -> bool:
        """Set the file's modification time to now (creating it); False when the file cannot be written."""
        try:
            self.path.touch(exist_ok=True)
        except OSError as exc:
            log.warning("cannot touch the heartbeat file %s: %s", self.path, exc.strerror)
            return False
        return True

    def _stop_reason(self, state: ConsumerState) -> str | None:
        """Why the consumer does not consume right now, or None when it does."""
        if not state.connected:
            return "the consumer has no broker connection"
        now = self._clock()
        if state.free_slots <= 0:
            self._stalled_since = None
            return None
        if self._stalled_since is not None and self._last_received >= self._stalled_since:
            self._stalled_since = None
        waiting = state.waiting()
        if waiting <= 0:
            self._stalled_since = None
            return None
        if self._stalled_since is None:
            self._stalled_since = now
        stalled = now - self._stalled_since
        if stalled < self._stall_s:
            return None
        return (
            f"{waiting} message(s) waited {stalled:.0f} s in this worker's queues while a pool process"
            " was free, and none arrived"
        )


def consumer_state(consumer: Any, reserved: Callable[[], int]) -> ConsumerState:
    """Read ``consumer`` (a Celery consumer) for one tick; ``reserved`` counts the task messages the worker holds.

    Queue sizes come from a passive declare on the consumer's own channel (the transport's public way to count
    ready messages; over Redis, an LLEN of each priority list on a pooled connection, never the one blocked in
    BRPOP). A queue the broker does not know yet (an empty Redis list does not exist) counts as empty.
    """
    connection, task_consumer = consumer.connection, consumer.task_consumer
    if connection is None or task_consumer is None or not connection.connected:
        return ConsumerState(connected=False, free_slots=0, waiting=lambda: 0)
    # Not caught here, a broker error raised inside the event loop's timer would restart the consumer.
    broker_errors = tuple(connection.connection_errors) + tuple(connection.channel_errors)
    free_slots = int(getattr(consumer.pool, "num_processes", 0) or 0) - reserved()

    def waiting() -> int:
        total = 0
        for queue in task_consumer.queues:
            try:
                total += int(task_consumer.channel.queue_declare(queue=queue.name, passive=True)[1])
            except broker_errors:
                continue
        return total

    return ConsumerState(connected=True, free_slots=free_slots, waiting=waiting)


def watch(consumer: Any, heartbeat: Heartbeat, reserved: Callable[[], int], interval_s: float = INTERVAL_S) -> None:
    """Beat ``heartbeat`` now and every ``interval_s`` from ``consumer``'s timer.

    With the prefork pool that timer is the consumer's event loop's: its entries run only while the loop runs,
    so a loop that hangs, or one stuck reconnecting, beats no more. Entries added after the consumer first
    reported ready outlive its reconnections (Celery cancels only the ones a connection registered).
    """

    def tick() -> None:
        heartbeat.beat(consumer_state(consumer, reserved))

    tick()
    consumer.timer.call_repeatedly(interval_s, tick)


def heartbeat_age(path: Path, now: float | None = None) -> float | None:
    """Seconds since ``path`` was last touched (wall clock), None when there is no such file."""
    try:
        modified = path.stat().st_mtime
    except FileNotFoundError:
        return None
    return (time.time() if now is None else now) - modified


def schema_ready(current: Collection[str], head: str, known: Collection[str]) -> bool:
    """Whether a database at revisions ``current`` serves a release whose newest migration is ``head``.

    True at ``head``, and at a revision this release does not know: a newer release migrated, and schema
    changes only add (or drop what the release before no longer reads), so an older worker still runs there (a
    rollback). An empty database is not ready.
    """
    return head in current or any(revision not in known for revision in current)


def _schema_revisions(settings: Settings) -> tuple[set[str], str, set[str]]:
    """The database's current revisions, this release's head and every revision it knows.

    Raises:
        sqlalchemy.exc.SQLAlchemyError: the database cannot be read (not up yet, say).
    """
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    from store.database import MIGRATIONS, make_engine

    script = ScriptDirectory(str(MIGRATIONS))
    known = {revision.revision for revision in script.walk_revisions()}
    engine = make_engine(settings, pooled=False)
    try:
        with engine.connect() as connection:
            current = set(MigrationContext.configure(connection).get_current_heads())
    finally:
        engine.dispose()
    return current, script.get_current_head() or "", known


def _check(args: argparse.Namespace) -> int:
    path = Path(args.file) if args.file else None
    if path is None:
        configured = load_settings().heartbeat_file
        if not configured:
            print("LOUSHO_HEARTBEAT_FILE is not set (and no --file): there is no heartbeat to check", file=sys.stderr)
            return 2
        path = Path(configured)
    age = heartbeat_age(path)
    if age is None:
        print(f"no heartbeat file at {path}: the worker never reported ready", file=sys.stderr)
        return 1
    if age > args.max_age:
        print(
            f"the heartbeat file is {age:.0f} s old (at most {args.max_age:g} s): the worker stopped consuming",
            file=sys.stderr,
        )
        return 1
    return 0


def _schema(args: argparse.Namespace) -> int:
    from sqlalchemy.exc import SQLAlchemyError

    settings = load_settings()
    deadline = time.monotonic() + args.wait
    while True:
        try:
            current, head, known = _schema_revisions(settings)
        except SQLAlchemyError as exc:
            problem = f"the database cannot be read yet ({type(exc).__name__})"
        else:
            if schema_ready(current, head, known):
                return 0
            problem = f"the schema is at {sorted(current) or 'nothing'}, this release needs {head}: run lousho migrate"
        if time.monotonic() >= deadline:
            print(problem, file=sys.stderr)
            return 1
        print(f"waiting: {problem}", file=sys.stderr)
        time.sleep(SCHEMA_POLL_S)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m worker.probes", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="exit 1 when the worker's heartbeat file is missing or too old")
    check.add_argument("--file", help="the heartbeat file (default: LOUSHO_HEARTBEAT_FILE)")
    check.add_argument("--max-age", type=float, default=MAX_AGE_S, help="oldest passing age in seconds")
    check.set_defaults(run=_check)
    schema = commands.add_parser("schema", help="exit 0 once the database schema is this release's, 1 otherwise")
    schema.add_argument("--wait", type=float, default=0.0, help="seconds to wait for it before giving up")
    schema.set_defaults(run=_schema)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``check`` or ``schema``: 0 passes, 1 fails, 2 for a configuration problem."""
    args = _parser().parse_args(argv)
    try:
        status: int = args.run(args)
    except errors.ConfigurationError as exc:
        print(f"configuration: {exc}", file=sys.stderr)
        return 2
    return status


if __name__ == "__main__":
    sys.exit(main())
