"""The real ``lousho.recover`` task run in this process, on the test settings, the way beat would run it."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.support.http_fixtures import Receiver


def run_recover_sweep(receiver: Receiver, monkeypatch: pytest.MonkeyPatch, session_id: str) -> float:
    """Call ``worker.tasks.recover()`` every recover interval until it re-sends ``session_id``.

    The task runs unchanged; only what a worker process builds at start is swapped for the test's:
    its settings, its step dependencies (store and leases on the test services) and its publisher
    (the driver's queue instead of the broker). Returns the seconds it took.
    """
    from worker import tasks

    settings = receiver.settings
    sent: list[str] = []

    def enqueue(run_id: str, seq: int | None = None, *args: Any, **kwargs: Any) -> None:
        sent.append(run_id)
        receiver.driver.enqueue(run_id, seq)

    monkeypatch.setattr(tasks, "settings", settings)
    monkeypatch.setattr(tasks, "deps", lambda: receiver.driver.deps)
    monkeypatch.setattr(tasks, "enqueue", enqueue)
    started = time.monotonic()
    # A run is stale after one lease TTL; beat runs the sweep every interval. Slack for a loaded machine.
    deadline = started + settings.lease_ttl_ms / 1000 + 3 * settings.recover_interval_s + 10
    while session_id not in sent:
        assert time.monotonic() < deadline, f"the recover sweep never re-sent {session_id}"
        tasks.recover()
        if session_id not in sent:
            time.sleep(settings.recover_interval_s)
    return time.monotonic() - started
