"""Named crash points for the crash tests: a process dies, or stops, on purpose at an exact place in a step.

Armed with ``LOUSHO_CRASH_AT=point[:session_prefix],...`` (the process exits as SIGKILL would) or
``LOUSHO_STOP_AT=...`` (the process sends itself SIGSTOP, and a test sends SIGCONT later: a stalled lease
holder at that point), and ``LOUSHO_CRASH_DIR``; each point fires once per run (a marker file holding the pid
records it), so the run recovers afterwards. Unarmed, a crash point costs two dictionary lookups.
"""

from __future__ import annotations

import os
import signal


def _armed(variable: str) -> dict[str, str]:
    armed: dict[str, str] = {}
    for item in filter(None, os.environ.get(variable, "").split(",")):
        point, _, prefix = item.partition(":")
        armed[point.strip()] = prefix.strip()
    return armed


_ARMED = _armed("LOUSHO_CRASH_AT")
_STOPS = _armed("LOUSHO_STOP_AT")


def _first_time(kind: str, point: str, session_id: str) -> bool:
    """Leave the marker of ``point`` for the run; False when it was left before (the point fired already)."""
    directory = os.environ.get("LOUSHO_CRASH_DIR", "/tmp")
    marker = os.path.join(directory, f"{kind}-{point}-{session_id}")
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return False
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    return True


def crash_point(point: str, session_id: str) -> None:
    """Kill (or stop) this process the first time ``point`` is reached for a matching run."""
    stop = _STOPS.get(point)
    if stop is not None and session_id.startswith(stop) and _first_time("stop", point, session_id):
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    prefix = _ARMED.get(point)
    if prefix is None or not session_id.startswith(prefix):
        return
    if _first_time("crash", point, session_id):
        os._exit(137)
