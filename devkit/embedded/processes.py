"""Server processes of the embedded services: free ports, launching without root rights, finding and stopping.

It knows nothing of Postgres or Redis: the server modules say what to run and with which signal it stops.
It must never signal a process it cannot tie to a server of ours (a reused pid is not ours).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, NamedTuple

from devkit.errors import EmbeddedError

HOST = "127.0.0.1"
INSTALL_HINT = "install the embedded servers with: pip install 'lousho-worker[embedded]'"


class RunningServer(NamedTuple):
    """A live server of the folder, verified by asking it (see the servers' ``running``)."""

    pid: int
    port: int
    created: float


# Popen handles of the servers this process started, so that stopping them also reaps them.
_children: dict[int, subprocess.Popen[bytes]] = {}
_drop_prefix: list[str] | None = None


def unprivileged_prefix() -> list[str]:
    """Command prefix that runs a program without root rights; empty when not root.

    Raises:
        EmbeddedError: running as root and neither ``unshare`` nor ``setpriv`` is available.
    """
    global _drop_prefix
    if os.geteuid() != 0:
        return []
    if _drop_prefix is not None:
        return _drop_prefix
    try:
        nobody = pwd.getpwnam("nobody")
        uid, gid = nobody.pw_uid, nobody.pw_gid
    except KeyError:
        uid = gid = 65534
    unshare = shutil.which("unshare")
    if unshare:
        prefix = [unshare, "--user", f"--map-user={uid}", f"--map-group={gid}", "--"]
        probe = subprocess.run(
            [*prefix, "true"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=False,
        )
        if probe.returncode == 0:
            _drop_prefix = prefix
            return prefix
    setpriv = shutil.which("setpriv")
    if setpriv:
        _drop_prefix = [setpriv, f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--"]
        return _drop_prefix
    raise EmbeddedError("PostgreSQL refuses to run as root and neither unshare nor setpriv is available")


def owner_for(prefix: Sequence[str]) -> tuple[int, int] | None:
    """The uid and gid that must own a server's files when it runs through ``setpriv`` (else None)."""
    if not prefix or not Path(prefix[0]).name.startswith("setpriv"):
        return None
    uid = int(prefix[1].split("=", 1)[1])
    gid = int(prefix[2].split("=", 1)[1])
    return uid, gid


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((HOST, port))
        except OSError:
            return False
    return True


def pick_port(*candidates: int | None) -> int:
    """The first free port among ``candidates`` (None and 0 are skipped), else any free port on 127.0.0.1."""
    for port in candidates:
        if port and _port_free(port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        chosen: int = probe.getsockname()[1]
        return chosen


def find_process(pid: int | None, created: float | None) -> Any | None:
    """The live (non-zombie) process ``pid`` started at ``created`` (any start time when None), else None."""
    import psutil

    if not pid:
        return None
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        if created is not None and abs(process.create_time() - created) > 1.0:
            return None  # the pid was reused by another process
        return process
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def create_time(pid: int) -> float:
    """When process ``pid`` started (what the state file records to recognise it later)."""
    import psutil

    created: float = psutil.Process(pid).create_time()
    return created


def launch(command: list[str], log: IO[bytes], **options: Any) -> subprocess.Popen[bytes]:
    """Start a server in a session of its own, its output going to ``log``; ``terminate`` reaps it later."""
    process = subprocess.Popen(
        command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **options
    )
    _children[process.pid] = process
    return process


def terminate(pid: int, first: signal.Signals, timeout: float) -> None:
    """Signal ``pid``, wait for it and every process it had forked, SIGKILL what remains."""
    import psutil

    try:
        process = psutil.Process(pid)
        family = [process, *process.children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, first)
    child = _children.pop(pid, None)
    if child is not None:  # ours: reap it so no zombie is left behind
        try:
            child.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    _, alive = psutil.wait_procs(family, timeout=timeout if child is None else 1.0)
    for leftover in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            leftover.kill()
    psutil.wait_procs(alive, timeout=5)
    if child is not None and child.poll() is None:
        child.wait(5)


def family(pid: int | None, created: float | None) -> list[int]:
    """``pid`` and every process it forked, when it still runs (see ``find_process``); else ``[]``."""
    import psutil

    process = find_process(pid, created)
    if process is None:
        return []
    with contextlib.suppress(psutil.NoSuchProcess):
        return [process.pid, *(child.pid for child in process.children(recursive=True))]
    return []
