"""Named crash points for the crash tests: a process dies, or stops, on purpose at an exact place in a step.

Armed with ``LOUSHO_CRASH_AT=point[:session_prefix],...`` (the process exits as SIGKILL would) or
``LOUSHO_STOP_AT=...`` (the process sends itself SIGSTOP, and a test sends SIGCONT later: a stalled lease
holder at that point), and ``LOUSHO_CRASH_DIR``; each point fires once per run (a marker file holding the pid
records it), so the run recovers afterwards. Unarmed, a crash point costs two dictionary lookups.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator


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


#: Every crash point a step passes, by name (``worker.testing.run_local(crash_at=...)`` checks names against it).
POINTS = frozenset(
    {
        "after_approved_effect_before_result_save",
        "after_batch_save_before_enqueue",
        "after_end_hooks_before_note",
        "after_enqueue_before_ack",
        "after_lease_before_epoch",
        "after_model_response_before_save",
        "after_model_save_before_enqueue",
        "after_once_effect_before_result_save",
        "after_started_marker_before_approved_call",
        "after_started_marker_before_once_call",
        "after_tool_effect_before_result_save",
        "approval_decided_before_resume_enqueue",
        "before_started_marker",
        "between_chained_steps",
        "between_results",
        "during_model_call",
        "tool_before_effect",
    }
)


class SimulatedCrash(BaseException):  # not an error: a process death, played in process
    """Raised at an armed point by ``simulating``: the step stops there as if its process had died.

    A ``BaseException``, so no handler of a step turns it into a result or a retry.
    """

    def __init__(self, point: str, session_id: str) -> None:
        super().__init__(f"simulated crash at {point} in run {session_id}")
        self.point = point
        self.session_id = session_id


_simulated_lock = threading.Lock()
#: The points ``simulating`` armed in this process, and those that fired.
_simulated: tuple[frozenset[str], set[str]] | None = None


@contextlib.contextmanager
def simulating(points: frozenset[str]) -> Iterator[set[str]]:
    """Raise ``SimulatedCrash`` the first time each of ``points`` is reached in this process, inside the block.

    Yields the points that fired. For one in-process runner at a time (``worker.testing.run_local``).
    """
    global _simulated
    fired: set[str] = set()
    with _simulated_lock:
        before, _simulated = _simulated, (points, fired)
    try:
        yield fired
    finally:
        with _simulated_lock:
            _simulated = before


def crash_point(point: str, session_id: str) -> None:
    """Kill (or stop) this process the first time ``point`` is reached for a matching run."""
    simulated = _simulated
    if simulated is not None and point in simulated[0]:
        with _simulated_lock:
            first = point not in simulated[1]
            simulated[1].add(point)
        if first:
            raise SimulatedCrash(point, session_id)
    stop = _STOPS.get(point)
    if stop is not None and session_id.startswith(stop) and _first_time("stop", point, session_id):
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    prefix = _ARMED.get(point)
    if prefix is None or not session_id.startswith(prefix):
        return
    if _first_time("crash", point, session_id):
        os._exit(137)
