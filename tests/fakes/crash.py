"""Crashes at named crash points, in process: the step stops dead, as a SIGKILL would stop it.

A crash is a ``BaseException`` so no ``except Exception`` in step code can swallow it. While it
unwinds, the lease is not released (a killed process releases nothing): it stays until it expires.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from store import interfaces
from store.records import Lease
from worker import batch, batch_state, steps

#: Modules that imported ``crash_point`` by name; each gets the in-process version.
_PATCHED_MODULES = (steps, batch, batch_state)


class SimulatedCrash(BaseException):
    """The worker process died at a crash point."""

    def __init__(self, point: str, session_id: str) -> None:
        super().__init__(f"crash at {point} for {session_id}")
        self.point, self.session_id = point, session_id


@dataclass
class Crashes:
    """The armed crash points of one test, and the points each step passed through."""

    armed: set[tuple[str, str | None]] = field(default_factory=set)
    fired: list[tuple[str, str]] = field(default_factory=list)
    passed: list[tuple[str, str]] = field(default_factory=list)
    _dying: threading.Event = field(default_factory=threading.Event)

    def arm(self, point: str, session_id: str | None = None) -> None:
        """Crash the next time ``point`` is reached (for ``session_id``, or any run)."""
        self.armed.add((point, session_id))

    def disarm(self, session_id: str | None = None) -> None:
        """Drop the armed points of one run (or all of them)."""
        self.armed = {(p, s) for p, s in self.armed if session_id is not None and s != session_id}

    def crash_point(self, point: str, session_id: str) -> None:
        """The replacement of ``store.faults.crash_point``."""
        self.passed.append((point, session_id))
        if self._dying.is_set():
            raise SimulatedCrash(point, session_id)  # a dead process runs no further code
        for key in ((point, session_id), (point, None)):
            if key in self.armed:
                self.armed.discard(key)
                self.fired.append((point, session_id))
                self._dying.set()
                raise SimulatedCrash(point, session_id)

    def recovered(self) -> None:
        """The crashed step is gone; later steps run in a new, healthy process."""
        self._dying.clear()

    @contextmanager
    def installed(self, leases: interfaces.Leases) -> Iterator[Crashes]:
        """Route crash points here, and keep ``leases`` from releasing anything while a step dies."""
        originals = [(module, module.crash_point) for module in _PATCHED_MODULES]
        shadowed = "release" in vars(leases)
        release = leases.release

        def release_unless_dying(lease: Lease) -> bool:
            return False if self._dying.is_set() else release(lease)

        for module, _ in originals:
            module.crash_point = self.crash_point  # type: ignore[attr-defined]  # swapped for the test
        leases.release = release_unless_dying  # type: ignore[method-assign]  # swapped for the test
        try:
            yield self
        finally:
            for module, original in originals:
                module.crash_point = original  # type: ignore[attr-defined]
            if shadowed:
                leases.release = release  # type: ignore[method-assign]
            else:
                del leases.release


def die_at(point: str, session_id: str, leases: interfaces.Leases, deliver: Callable[[], object]) -> None:
    """Arm ``point`` for ``session_id`` and call ``deliver`` (steps the run) until the step dies there.

    The dead step's lease is left in place, as a killed worker leaves it: the caller lets it expire.
    """
    crashes = Crashes()
    with crashes.installed(leases):
        crashes.arm(point, session_id)
        try:
            deliver()
        except SimulatedCrash:
            return
        finally:
            crashes.recovered()
    raise AssertionError(f"the run {session_id!r} never reached {point}")
