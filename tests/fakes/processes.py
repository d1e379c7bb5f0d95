"""Processes of this host for the lease-takeover checks: one that runs, one that has exited, and owner ids naming them.

A lease names its holder by host, boot, PID namespace, PID and start time (``store.owners``); these helpers make
owner ids as another process of this host would write them, without that process taking any lease.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from store import owners

#: Upper bound on waiting for a process this module started to exit.
WAIT_S = 10.0


def owner_of(pid: int, **changes: object) -> str:
    """The owner id process ``pid`` of this host would write, with ``changes`` (``host=``, ``start=``...) applied."""
    start = owners.process_start(pid)
    assert start is not None, f"process {pid} is not running"
    me = owners.this_process()
    found = owners.Owner(me.host, pid, start, me.boot, me.pidns, "f00d")
    return str(dataclasses.replace(found, **changes))  # type: ignore[arg-type]  # the test names real fields


@contextmanager
def running() -> Iterator[subprocess.Popen[bytes]]:
    """A process that runs until the block ends (it waits on its standard input)."""
    process = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        yield process
    finally:
        process.kill()
        process.wait(WAIT_S)
        if process.stdin is not None:
            process.stdin.close()


def exited_owner() -> str:
    """The owner id of a process of this host that ran, then exited (and was reaped)."""
    with running() as process:
        owner = owner_of(process.pid)
    return owner
