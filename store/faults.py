"""Named crash points for the crash tests: a process dies on purpose at an exact place in a step.

Armed with ``LOUSHO_CRASH_AT=point[:session_prefix],...`` and ``LOUSHO_CRASH_DIR``; each point
fires once per run (a marker file records it), so the run recovers afterwards. Unarmed, a crash
point costs one dictionary lookup.
"""

from __future__ import annotations

import os

_ARMED: dict[str, str] = {}
for _item in filter(None, os.environ.get("LOUSHO_CRASH_AT", "").split(",")):
    _point, _, _prefix = _item.partition(":")
    _ARMED[_point.strip()] = _prefix.strip()


def crash_point(point: str, session_id: str) -> None:
    """Kill this process (as SIGKILL would) the first time ``point`` is reached for a matching run."""
    prefix = _ARMED.get(point)
    if prefix is None or not session_id.startswith(prefix):
        return
    directory = os.environ.get("LOUSHO_CRASH_DIR", "/tmp")
    marker = os.path.join(directory, f"crash-{point}-{session_id}")
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    os._exit(137)
