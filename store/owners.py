"""Lease owner ids: which process of which host holds a run lease, and whether that process is provably gone.

An owner id is ``host:pid:start:boot:pidns:nonce``: the host name, the process id, the process's start time
(clock ticks since boot, from ``/proc/<pid>/stat``), the kernel's boot id, the PID namespace and a random part
per lease. A lease may be taken over before its TTL only when ``is_gone`` says its holder is gone: the same
host, boot and PID namespace, and a process that has exited or whose PID now names a process started at
another time. Anything else (another host, another container, a system without ``/proc``, an id this module
cannot read) is never judged gone: its lease runs out its TTL. This module only reads ``/proc``; it must not
touch Redis nor decide what to do with a lease.
"""

from __future__ import annotations

import errno
import os
import socket
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Owner", "is_gone", "is_running", "new_owner", "parse", "process_start", "this_process"]

_PROC = Path("/proc")
#: What stands for a part this system does not provide (no ``/proc``): such an owner is never judged gone.
_UNKNOWN = "-"


@dataclass(frozen=True)
class Owner:
    """The parts of an owner id (``nonce`` tells apart the leases of one process)."""

    host: str
    pid: int
    start: int
    boot: str
    pidns: str
    nonce: str = ""

    def __str__(self) -> str:
        return f"{self.host}:{self.pid}:{self.start}:{self.boot}:{self.pidns}:{self.nonce}"

    def same_kernel_view(self, other: Owner) -> bool:
        """Whether both name processes that see the same process table (same host, boot and PID namespace)."""
        return (
            _UNKNOWN not in (self.boot, self.pidns)
            and self.host == other.host
            and self.boot == other.boot
            and self.pidns == other.pidns
        )


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` from the state on (field 3), None when the process is not there."""
    stat = _read(_PROC / str(pid) / "stat")
    if stat is None:
        return None
    # The command name may hold spaces and parentheses: the fields resume after the last ')'.
    return stat[stat.rfind(")") + 2 :].split()


def process_start(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot; None when it is not running (or unknown)."""
    fields = _stat_fields(pid)
    if fields is None or len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def _host() -> str:
    return socket.gethostname().replace(":", "-") or _UNKNOWN


def _pidns() -> str:
    try:
        link = os.readlink(_PROC / "self" / "ns" / "pid")  # "pid:[4026531836]"
    except OSError:
        return _UNKNOWN
    return "".join(ch for ch in link if ch.isdigit()) or _UNKNOWN


_this: tuple[int, Owner | None] = (0, None)


def this_process() -> Owner:
    """This process as an owner without a nonce (read once per process: a forked child reads its own)."""
    global _this
    pid = os.getpid()
    cached = _this[1]
    if _this[0] != pid or cached is None:
        boot = _read(_PROC / "sys" / "kernel" / "random" / "boot_id") or _UNKNOWN
        start = process_start(pid)
        cached = Owner(_host(), pid, start if start is not None else 0, boot.replace(":", "-"), _pidns())
        _this = (pid, cached)
    return cached


_prefix: tuple[int, str] = (0, "")


def new_owner() -> str:
    """A new owner id for one lease taken by this process."""
    global _prefix
    pid = os.getpid()
    if _prefix[0] != pid:
        _prefix = (pid, str(this_process()))  # ends with ':' (no nonce)
    return _prefix[1] + os.urandom(6).hex()


def parse(owner: str) -> Owner | None:
    """The parts of an owner id; None for one this release does not write (an older release's, or a test's)."""
    parts = owner.split(":")
    if len(parts) != 6 or not (parts[1].isdigit() and parts[2].isdigit()):
        return None
    return Owner(parts[0], int(parts[1]), int(parts[2]), parts[3], parts[4], parts[5])


def _exists(pid: int) -> bool:
    """Whether a process ``pid`` exists though ``/proc`` does not show it (``hidepid``): signal 0 says so."""
    try:
        os.kill(pid, 0)
    except OSError as exc:
        return exc.errno != errno.ESRCH
    return True


def is_running(pid: int) -> bool:
    """Whether process ``pid`` of this PID namespace runs (an exited one not yet reaped does not)."""
    fields = _stat_fields(pid)
    if fields is None:
        return pid > 0 and _exists(pid)
    return fields[0] not in ("Z", "X")


def is_gone(owner: str) -> bool:
    """Whether the process that holds a lease under ``owner`` is provably gone.

    True only for a process of this host, boot and PID namespace that has exited (a zombie counts as exited),
    or whose PID now belongs to a process started at another time (the PID was reused). A process of another
    host or container, this process itself, or an id that cannot be read is never gone: waiting for the TTL
    is always safe, taking over a live holder's lease is not.
    """
    holder = parse(owner)
    me = this_process()
    if holder is None or not holder.same_kernel_view(me) or holder.pid == me.pid or holder.pid <= 0:
        return False
    fields = _stat_fields(holder.pid)
    if fields is None:
        # Not in /proc: gone, unless /proc hides other users' processes and the PID still answers.
        return not _exists(holder.pid)
    if fields[0] in ("Z", "X"):
        return True
    return len(fields) >= 20 and int(fields[19]) != holder.start
