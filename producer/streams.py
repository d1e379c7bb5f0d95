"""Following a run's events from any process: durable ones from Postgres, live signals from Redis.

A reader pages through ``run_events`` after the last seq it yielded, so a consumer that dies and comes back
with that seq misses nothing and sees nothing twice. Between pages it waits on the run's Redis channel:
steps publish a note after each save that wrote events, and live signals, while a consumer watches (the
reader keeps the run's watch key alive). Without Redis, or between notes, it polls Postgres.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Executor
from datetime import UTC, datetime
from typing import Any

from store import errors, events, interfaces
from store.events import Event
from store.signals import RedisSignals, Subscription

__all__ = ["follow", "follow_async"]

log = logging.getLogger("lousho.client")

#: Events read per page.
PAGE = 500
#: Longest wait for a note before Postgres is read again (a step learns that someone watches at its next
#: lease renewal, so the first notes of a step already running can be missing).
POLL_S = 0.5
#: Lifetime of the watch key; the reader renews it every third of it.
WATCH_TTL_MS = 30_000

#: Whether an event starts what the reader should yield (None: everything after the position).
StartFilter = Callable[[Event], bool] | None


def follow(
    store: interfaces.ProducerStore,
    signals: RedisSignals | None,
    session_id: str,
    after: int,
    *,
    starts: StartFilter = None,
    live: bool = False,
    timeout: float | None = None,
    stop: threading.Event | None = None,
) -> Iterator[Event]:
    """Durable events of the run after seq ``after``, blocking for new ones, until the first ``run.done``.

    With ``starts``, events are skipped until one it accepts (that one is yielded). ``live`` interleaves
    live signals (seq None) heard while waiting. ``stop`` ends it early (checked at least every ``POLL_S``).

    Raises:
        RunTimeoutError: ``timeout`` seconds passed before the ``run.done`` (the run goes on).
        CheckpointNotFoundError: the run was deleted meanwhile.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    subscription = _subscribe(signals, session_id)
    cursor = _Cursor(after, starts)
    watched_at = read_at = 0.0
    noted, ended = True, False
    try:
        while stop is None or not stop.is_set():
            now = time.monotonic()
            if signals is not None and now - watched_at > WATCH_TTL_MS / 3000:
                watched_at = _watch(signals, session_id)
            if noted or now >= read_at:
                # Postgres is read on a note (every signal published before it has been heard) or when the
                # poll interval passed; never just because a live signal came, so signals keep their place.
                page = store.read_events(session_id, cursor.position, PAGE)
                if live and not ended and any(event.type == "run.done" for event in page):
                    # A read found the end before the note of the save that wrote it (a poll, or the note of an
                    # earlier save): the signals published before that save are heard first (its note follows
                    # them on the channel), so the last turn's text is not cut.
                    yield from _until_note(subscription, session_id)
                for event in cursor.take(page):
                    yield event
                    if event.type == "run.done":
                        return
                if len(page) == PAGE:
                    continue
                if not page and store.progress(session_id) is None:
                    raise errors.CheckpointNotFoundError(f"run {session_id!r} is not stored")
                read_at = now + POLL_S
            wait = read_at - time.monotonic()
            if deadline is not None:
                if deadline - time.monotonic() <= 0:
                    raise errors.RunTimeoutError(f"run {session_id!r} did not finish its input within {timeout} s")
                wait = min(wait, deadline - time.monotonic())
            heard, noted, ends = _heard(subscription, session_id, max(wait, 0.0))
            ended = ended or ends
            if live:
                yield from heard
    finally:
        _close(subscription)


class _Cursor:
    """Where a reader stands: the last seq it passed, and whether it reached its start yet."""

    def __init__(self, after: int, starts: StartFilter) -> None:
        self.position = after
        self._starts = starts

    def take(self, page: list[Event]) -> Iterator[Event]:
        """The events of ``page`` to yield, moving the position past each."""
        for event in page:
            self.position = event.seq if event.seq is not None else self.position
            if self._starts is not None:
                if not self._starts(event):
                    continue
                self._starts = None
            yield event


def _close(subscription: Subscription | None) -> None:
    if subscription is not None:
        try:
            subscription.close()
        except errors.StorageError:
            log.debug("could not close the channel of a run")


async def follow_async(
    make: Callable[[threading.Event], Iterator[Event]], executor: Executor | None = None
) -> AsyncIterator[Event]:
    """The iterator ``make(stop)`` builds, for ``async for``: it is built and pulled in ``executor``'s threads.

    ``executor`` None is the event loop's default executor (a few threads: a server following many runs at once
    passes a larger one). When the loop stops early (a client went away, the task was cancelled), ``stop`` is
    set and the thread still inside the iterator returns within ``POLL_S``; then the iterator is closed.
    """
    loop = asyncio.get_running_loop()
    stop = threading.Event()
    done = object()
    iterator = await loop.run_in_executor(executor, make, stop)
    pending: asyncio.Future[Any] | None = None
    try:
        while True:
            pending = loop.run_in_executor(executor, next, iterator, done)
            event = await asyncio.shield(pending)
            pending = None
            if event is done:
                return
            assert isinstance(event, Event)
            yield event
    finally:
        stop.set()
        if pending is not None:
            with contextlib.suppress(Exception):
                await pending
        await loop.run_in_executor(executor, _close_iterator, iterator)


def _close_iterator(iterator: Iterator[Event]) -> None:
    close = getattr(iterator, "close", None)
    if close is not None:
        close()


def _subscribe(signals: RedisSignals | None, session_id: str) -> Subscription | None:
    if signals is None:
        return None
    try:
        return signals.subscribe(session_id)
    except errors.StorageError as exc:
        log.info("event notes unavailable (%s); polling the run's events", type(exc).__name__)
        return None


def _watch(signals: RedisSignals, session_id: str) -> float:
    try:
        signals.watch(session_id, WATCH_TTL_MS)
    except errors.StorageError as exc:
        log.debug("could not mark a run watched: %s", type(exc).__name__)
    return time.monotonic()


def _until_note(subscription: Subscription | None, session_id: str) -> Iterator[Event]:
    """Live signals heard until the note of a save that ended the input arrives, for at most ``POLL_S``.

    Bounded, because a ``run.done`` written without a note (by a client's abort, or by a step that did not know the
    run was watched) has no note to wait for.
    """
    deadline = time.monotonic() + POLL_S
    ended = False
    while not ended and subscription is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        heard, _, ended = _heard(subscription, session_id, left)
        yield from heard


def _heard(subscription: Subscription | None, session_id: str, wait: float) -> tuple[list[Event], bool, bool]:
    """Live signals heard within ``wait`` seconds, whether a note came with them, and whether a note ended the input.

    A note says a save wrote events; one that ends the input says its save wrote a ``run.done``. Returns as soon
    as something arrived, with everything already received.
    """
    if subscription is None:
        time.sleep(wait)
        return [], False, False
    heard: list[Event] = []
    noted = ended = False
    try:
        message = subscription.get_message(timeout=wait)
        while message is not None:
            body = _body(message.get("data"))
            signal = _signal(session_id, body)
            if signal is not None:
                heard.append(signal)
            else:
                noted = True
                ended = ended or body.get("ends") is True
            message = subscription.get_message(timeout=0)
    except errors.StorageError as exc:
        log.debug("lost the channel of a run (%s); polling", type(exc).__name__)
        time.sleep(wait)
    return heard, noted, ended


def _body(data: Any) -> dict[str, Any]:
    """A channel message's JSON object, empty when it is not one.

    A live signal, or a note: ``{"saved": true}``, with ``"ends": true`` when the save ended the input.
    """
    try:
        body = json.loads(data)
    except (TypeError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


def _signal(session_id: str, body: dict[str, Any]) -> Event | None:
    """A live signal from a channel message's body (None for a note, or anything unreadable)."""
    if body.get("type") not in events.LIVE or not isinstance(body.get("data"), dict):
        return None
    try:
        at = datetime.fromisoformat(body["at"])
    except (KeyError, TypeError, ValueError):
        at = datetime.now(UTC)
    return events.live(session_id, body["type"], body["data"], at)


def follow_tree(
    store: interfaces.ProducerStore,
    session_id: str,
    after: int,
    *,
    timeout: float | None = None,
    stop: threading.Event | None = None,
) -> Iterator[Event]:
    """A run's durable events after seq ``after`` and its sub-agents', in time order, until the run's ``run.done``.

    A child's events (each with its own run id and seq) carry ``data["subagent"]``: ``name``, ``depth``,
    ``tool_call_id`` and ``parent`` (the run that started it); a child is followed from its lead's
    ``subagent.start`` on, and so are its own children. Read from Postgres every ``POLL_S`` seconds.

    Raises:
        RunTimeoutError: ``timeout`` seconds passed first.
    """
    cursors: dict[str, int] = {session_id: after}
    tags: dict[str, dict[str, Any]] = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        found = _read_tree(store, session_id, cursors, tags)
        ended = any(e.run_id == session_id and e.type == "run.done" for e in found)
        while ended and (more := _read_tree(store, session_id, cursors, tags)):
            found.extend(more)  # children first read at the end: read them whole before the run's end
        found.sort(key=lambda e: (e.at, e.run_id != session_id))
        for event in found:
            yield event
            if event.run_id == session_id and event.type == "run.done":
                return
        if stop is not None and stop.is_set():
            return
        if deadline is not None and time.monotonic() >= deadline:
            raise errors.RunTimeoutError(f"no end of run {session_id!r} within {timeout} s")
        time.sleep(POLL_S)


def _read_tree(
    store: interfaces.ProducerStore, session_id: str, cursors: dict[str, int], tags: dict[str, dict[str, Any]]
) -> list[Event]:
    """One page of each followed run's new events (children tagged), adding children that were started."""
    found: list[Event] = []
    for run_id in list(cursors):
        for event in store.read_events(run_id, cursors[run_id], 500):
            cursors[run_id] = int(event.seq or 0)
            found.append(
                event
                if run_id == session_id
                else event.model_copy(update={"data": {**event.data, "subagent": tags[run_id]}})
            )
            child = event.data.get("child_run_id") if event.type == "subagent.start" else None
            if isinstance(child, str) and child not in cursors:
                cursors[child] = -1
                tags[child] = {
                    "name": event.data.get("agent"),
                    "depth": tags.get(run_id, {}).get("depth", 0) + 1,
                    "tool_call_id": event.data.get("tool_call_id"),
                    "parent": run_id,
                }
    return found
