"""In-task timing for benchmark workers: one line per finished task, appended to a shared file.

Installed by ``bench.agents`` (inside Lousho worker processes) and ``bench.bare`` (inside the bare
worker) when ``BENCH_TIMINGS`` names a file; ``bench.dbos_peer`` calls ``record`` around each DBOS
step. Each line is ``task-name<TAB>first-arg<TAB>second-arg<TAB>start<TAB>end`` with wall-clock
seconds taken at Celery's ``task_prerun`` and ``task_postrun`` signals, i.e. the time the task body
ran, without broker delivery and ack. The file is opened per process with ``O_APPEND`` and written
with one ``os.write`` per task, so lines from concurrent processes never interleave and the cost is
a few microseconds, the same in every worker.
"""

from __future__ import annotations

import os
import time
from typing import Any

ENV = "BENCH_TIMINGS"

_starts: dict[str, float] = {}
_fd: dict[str, int] = {}  # pid -> descriptor, so a forked child opens its own
_installed: list[bool] = []


def _descriptor(path: str) -> int:
    key = str(os.getpid())
    if key not in _fd:
        _fd.clear()
        _fd[key] = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    return _fd[key]


def _prerun(task_id: str | None = None, **_: Any) -> None:
    if task_id is not None:
        _starts[task_id] = time.time()


def _postrun(task_id: str | None = None, task: Any = None, args: Any = None, kwargs: Any = None, **_: Any) -> None:
    end = time.time()
    start = _starts.pop(task_id or "", None)
    if start is None:
        return
    values = [*(args or ()), *(kwargs or {}).values(), None, None]
    record(getattr(task, "name", "?"), values[0], values[1], start, end)


def record(name: str, first: object, second: object, start: float, end: float) -> None:
    """Append one timing line (used by the signals above, and by the DBOS peer around each step)."""
    path = os.environ.get(ENV)
    if path:
        line = f"{name}\t{first}\t{second}\t{start:.6f}\t{end:.6f}\n"
        os.write(_descriptor(path), line.encode())


def install() -> bool:
    """Record task start and end times when ``BENCH_TIMINGS`` is set; True when recording."""
    if not os.environ.get(ENV):
        return False
    if _installed:
        return True
    from celery import signals

    signals.task_prerun.connect(_prerun, weak=False)
    signals.task_postrun.connect(_postrun, weak=False)
    _installed.append(True)
    return True
