"""The threads tool calls run on: one set per process, where calls given up on hold no place.

A call that cannot start in time is cancelled, never run late. Owns the threads and the count of hung calls
(calls given up on past their timeout that still run, which Python cannot stop); it must not decide what a call's
result is (``worker.batch``) nor end the process (``worker.tasks`` recycles a pool process past
``LOUSHO_HUNG_TOOL_CALLS_MAX``).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

__all__ = ["SIZE", "ToolFuture", "ToolThreads", "WaitOutcome", "process_threads"]

log = logging.getLogger("lousho.tools")

#: Threads a process keeps for the calls of its batches (hung calls not counted).
SIZE = 64
#: Seconds an idle thread waits for a call before it leaves the set (a busy process keeps its threads).
IDLE_S = 300.0

T = TypeVar("T")

#: How a wait on a call ended: it returned, it never started in time (cancelled: it never runs), or it started and
#: ran past its timeout (given up on: it may still take effect).
WaitOutcome = Literal["done", "not-started", "overdue"]


class ToolFuture(futures.Future[T], Generic[T]):
    """A ``Future`` that knows when its call started (monotonic seconds) and which thread runs it."""

    def __init__(self) -> None:
        super().__init__()
        self.started_at: float | None = None
        self.runner: _Runner | None = None


@dataclass(eq=False)
class _Runner:
    """One thread of the set."""

    #: Counted against the set's size; a thread started for one call on a busy set is not.
    counted: bool
    #: Its current call was given up on (``abandon``); a thread took its place.
    hung: bool = False


@dataclass(eq=False)
class _Job:
    future: ToolFuture[Any]
    fn: Callable[..., Any]
    args: tuple[Any, ...]


_in_set = threading.local()


class ToolThreads:
    """Up to ``size`` threads for tool calls, started on demand and kept; calls past them wait in order.

    A call given up on (``abandon``) no longer counts: the thread it holds is replaced when calls wait, and
    leaves the set once the call returns. A call made from a thread of the set (a timed call inside a batch
    running ``tool_concurrency`` calls at once), or submitted ``at_once`` (a batch's calls), never waits: on a
    busy set it starts on a thread of its own, so no batch waits on the set, nor on itself.
    """

    def __init__(self, size: int = SIZE) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._more = threading.Condition(self._lock)
        self._queue: collections.deque[_Job] = collections.deque()
        self._counted = 0
        self._idle = 0
        self._hung = 0

    @property
    def hung(self) -> int:
        """Calls given up on that still run."""
        with self._lock:
            return self._hung

    def submit(self, fn: Callable[..., T], *args: Any, at_once: bool = False) -> ToolFuture[T]:
        """Run ``fn(*args)`` on a thread of the set: now, or once a thread is free (cancel it to drop it).

        ``at_once``: never wait for a thread; when the set is busy the call gets a thread of its own (as a call
        made from a thread of the set always does). Raises ``RuntimeError`` when the system refuses a thread.
        """
        future: ToolFuture[T] = ToolFuture()
        job = _Job(future, fn, args)
        with self._lock:
            self._queue.append(job)
            try:
                if self._idle >= len(self._queue):
                    self._more.notify()
                elif self._counted < self.size:
                    self._start(_Runner(counted=True), None)
                elif at_once or getattr(_in_set, "member", False):
                    self._queue.pop()  # the job just added: it does not wait
                    self._start(_Runner(counted=False), job)
            except RuntimeError:
                if job in self._queue:
                    self._queue.remove(job)  # refused here, so it must never run later
                raise
        return future

    def wait(self, future: ToolFuture[T], timeout: float) -> WaitOutcome:
        """Wait for ``future`` up to ``timeout`` seconds from when its call started.

        A call still waiting for a thread after ``timeout`` is cancelled (it never runs); one running past
        ``timeout`` from its start is abandoned (its thread is replaced). Every wait ends by a deadline.
        """
        deadline = time.monotonic() + timeout
        while True:
            done, _ = futures.wait([future], timeout=max(deadline - time.monotonic(), 0.0))
            if done:
                return "done"
            if future.cancel():
                self.cancel_waiting([future])  # out of the queue: it holds no place there
                return "not-started"
            started = future.started_at
            if started is not None and started + timeout > time.monotonic():
                deadline = started + timeout  # it started late: it gets its whole time from its start
                continue
            if future.done():
                return "done"
            self.abandon(future)
            return "overdue"

    def abandon(self, future: ToolFuture[Any]) -> None:
        """Stop counting the thread that runs ``future``: a call given up on; a waiting call gets a new thread."""
        with self._lock:
            runner = future.runner
            if runner is None or runner.hung or future.done():
                return  # not started, or returned already
            runner.hung = True
            self._hung += 1
            if runner.counted:
                runner.counted = False
                self._counted -= 1
                if len(self._queue) > self._idle and self._counted < self.size:
                    self._start(_Runner(counted=True), None)
            hung = self._hung
        log.warning("a tool call ran past its timeout and still runs; %d such call(s) in this process", hung)

    def _start(self, runner: _Runner, first: _Job | None) -> None:
        """Start a thread (the lock is held): it runs ``first``, then what waits, while it is counted.

        Raises:
            RuntimeError: the system refused another thread (the count is left as it was).
        """
        thread = threading.Thread(target=self._serve, args=(runner, first), name="lousho-tool", daemon=True)
        thread.start()
        if runner.counted:
            self._counted += 1

    def cancel_waiting(self, running: list[futures.Future[Any]]) -> None:
        """Cancel those of ``running`` that have not started (they never will), and forget them."""
        with self._lock:
            dropped = [job for job in self._queue if job.future in running and job.future.cancel()]
            for job in dropped:
                self._queue.remove(job)

    def _returned(self, future: ToolFuture[Any], runner: _Runner) -> bool:
        """Note that ``runner``'s call returned (before its waiter hears it); whether the thread stays in the set."""
        with self._lock:
            future.runner = None  # too late to give it up now
            if runner.hung:
                # Given up on, and a thread took its place: it leaves, unless the set is short of one.
                runner.hung = False
                self._hung -= 1
                if self._counted < self.size:
                    runner.counted = True
                    self._counted += 1
            return runner.counted

    def _next(self, runner: _Runner) -> _Job | None:
        """The next waiting call for ``runner``; None when the thread leaves the set (idle for ``IDLE_S``)."""
        with self._lock:
            while not self._queue:
                self._idle += 1
                woken = self._more.wait(IDLE_S)
                self._idle -= 1
                if not woken and not self._queue:
                    runner.counted = False
                    self._counted -= 1
                    return None
            return self._queue.popleft()

    def _serve(self, runner: _Runner, job: _Job | None) -> None:
        """A thread's life: ``job`` (if given), then waiting calls while it is counted."""
        _in_set.member = True
        while job is not None or runner.counted:
            if job is None:
                job = self._next(runner)
                if job is None:
                    return
            call, job = job, None
            future = call.future
            # Set before the call counts as started: a waiter that cannot cancel it finds them.
            future.runner, future.started_at = runner, time.monotonic()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                value = call.fn(*call.args)
            except BaseException as exc:  # handed to the caller through the future, as an executor does
                self._returned(future, runner)
                future.set_exception(exc)
            else:
                self._returned(future, runner)
                future.set_result(value)


_threads: tuple[int, ToolThreads] | None = None


def process_threads() -> ToolThreads:
    """This process's tool threads, made once per process (threads do not survive a fork)."""
    global _threads
    if _threads is None or _threads[0] != os.getpid():
        _threads = (os.getpid(), ToolThreads())
    return _threads[1]
