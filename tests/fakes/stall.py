"""Stalls on demand: a tool or model call that blocks until the test lets it go, and a step run in
its own thread, so a second step can take the run over while the first one is frozen mid-step."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from worker.steps import Outcome

#: Upper bound on any wait for another thread; reaching it means a test is broken, not slow.
WAIT_S = 10.0


@dataclass
class _Pass:
    entered: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)


class Gate:
    """Blocks the first ``blocking`` callers of ``pass_through`` until each is released."""

    def __init__(self, blocking: int = 1, signal: threading.Event | None = None) -> None:
        self._lock = threading.Lock()
        self._passes = [_Pass() for _ in range(blocking)]
        self._next = 0
        #: Also set when a pass blocks (shared with a ``StepThread`` to wait for "blocked or done").
        self.signal = signal

    def pass_through(self) -> None:
        """Called by the tool or model; blocks while this pass is held."""
        with self._lock:
            index = self._next
            self._next += 1
        if index >= len(self._passes):
            return
        gate = self._passes[index]
        gate.entered.set()
        if self.signal is not None:
            self.signal.set()
        if not gate.released.wait(WAIT_S):
            raise TimeoutError(f"gate pass {index} was never released")

    def is_blocked(self, index: int = 0) -> bool:
        """Whether pass ``index`` was reached (and not necessarily released)."""
        return self._passes[index].entered.is_set()

    def wait_entered(self, index: int = 0) -> bool:
        """Wait until pass ``index`` is blocked; False if it never came."""
        return self._passes[index].entered.wait(WAIT_S)

    def release(self, index: int = 0) -> None:
        """Let pass ``index`` go on."""
        self._passes[index].released.set()

    def release_all(self) -> None:
        for gate in self._passes:
            gate.released.set()


class StepThread(threading.Thread):
    """Runs one step off the test thread and keeps its outcome (or what it raised)."""

    def __init__(self, step: Callable[[], Outcome], done: threading.Event | None = None) -> None:
        super().__init__(daemon=True)
        self._step = step
        self._done = done
        self.outcome: Outcome | None = None
        self.raised: BaseException | None = None

    def run(self) -> None:
        try:
            self.outcome = self._step()
        except BaseException as exc:  # handed to the test thread, which decides
            self.raised = exc
        finally:
            if self._done is not None:
                self._done.set()

    def result(self) -> Outcome:
        """Wait for the step and return its outcome, re-raising what it raised."""
        self.join(WAIT_S)
        if self.is_alive():
            raise TimeoutError("the step thread did not finish")
        if self.raised is not None:
            raise self.raised
        assert self.outcome is not None
        return self.outcome
