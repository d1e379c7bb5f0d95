"""A clock that moves only when a test moves it, shared by the in-memory store and leases."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

START = datetime(2030, 1, 1, tzinfo=UTC)


class FakeClock:
    """Callable like ``store.memory.Clock``; returns the same instant until ``advance``."""

    def __init__(self, start: datetime = START) -> None:
        self._now = start
        self._lock = threading.Lock()

    def __call__(self) -> datetime:
        with self._lock:
            return self._now

    def advance(self, seconds: float = 0.0, *, ms: float = 0.0) -> datetime:
        """Move time forward and return the new instant."""
        if seconds < 0 or ms < 0:
            raise ValueError("time only moves forward")
        with self._lock:
            self._now += timedelta(seconds=seconds, milliseconds=ms)
            return self._now
