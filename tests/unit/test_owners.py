"""Lease owner ids: what they name, and when their process counts as gone (``store.owners``)."""

from __future__ import annotations

import os
import subprocess
import sys

from store import owners
from tests.fakes import processes


def test_an_owner_id_names_this_host_process_start_time_boot_and_pid_namespace() -> None:
    # When this process makes two owner ids
    first, second = owners.new_owner(), owners.new_owner()
    # Then each reads back as this process, and only the nonce tells them apart
    me = owners.this_process()
    parsed = owners.parse(first)
    assert parsed is not None and parsed.pid == os.getpid() == me.pid
    assert (parsed.host, parsed.start, parsed.boot, parsed.pidns) == (me.host, me.start, me.boot, me.pidns)
    assert parsed.start == owners.process_start(os.getpid()) and str(parsed) == first
    assert first != second and first.rsplit(":", 1)[0] == second.rsplit(":", 1)[0]


def test_an_exited_process_not_yet_reaped_is_gone() -> None:
    # Given a child process that has exited but that its parent has not reaped (a zombie keeps its PID)
    process = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    owner = processes.owner_of(process.pid)
    assert not owners.is_gone(owner)
    assert process.stdin is not None
    process.stdin.close()
    os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)  # exited, still in the process table
    try:
        # Then its lease owner counts as gone
        assert owners.process_start(process.pid) is None
        assert owners.is_gone(owner)
    finally:
        process.wait(processes.WAIT_S)


def test_ids_this_release_does_not_write_are_never_gone() -> None:
    dead = owners.parse(processes.exited_owner())
    assert dead is not None
    for owner in (f"{dead.host}:{dead.pid}:0123456789ab", "memory:1", "", "a:b:c:d:e:f", f"{dead}:extra"):
        assert owners.parse(owner) is None
        assert not owners.is_gone(owner), owner
