"""The child processes of ``lousho dev``: Celery worker, beat and Flower, started and stopped in order.

Each child runs in a session of its own, so the terminal's Ctrl-C reaches only ``lousho dev``, which
stops them (SIGTERM, then SIGKILL of the whole group after a timeout). It must not pick services or print.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path


def _die_with_parent() -> None:
    """In a child before exec: receive SIGTERM if ``lousho dev`` itself dies (Linux only)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Child:
    """One ``celery`` process started by the supervisor."""

    name: str
    process: subprocess.Popen[bytes]


class Supervisor:
    """The ``celery -A worker ...`` children of ``lousho dev``, stopped in the order they were started."""

    def __init__(self, root: Path, env: dict[str, str]) -> None:
        """Children will run in ``root`` with ``env``; none starts until ``spawn``."""
        self.root = root
        self.env = env
        self.children: list[Child] = []

    def spawn(self, name: str, args: list[str], extra_env: Mapping[str, str] | None = None) -> Child:
        """Start ``celery -A worker ARGS...`` as child ``name``, with ``extra_env`` added to the environment."""
        process = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "worker", *args],
            cwd=self.root,
            env={**self.env, **(extra_env or {})},
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        child = Child(name, process)
        self.children.append(child)
        return child

    def exited(self) -> Child | None:
        """A child that exited on its own, if any."""
        return next((c for c in self.children if c.process.poll() is not None), None)

    def stop(self, timeout: float, hurry: Callable[[], bool]) -> None:
        """SIGTERM every child, wait up to ``timeout`` (less once ``hurry()``), SIGKILL what is left."""
        for child in self.children:  # a warm shutdown: running steps finish or are redelivered
            if child.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while any(c.process.poll() is None for c in self.children) and time.monotonic() < deadline and not hurry():
            time.sleep(0.05)
        for child in self.children:  # whatever is left of each group (pool processes included)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.process.pid, signal.SIGKILL)
            child.process.wait()
