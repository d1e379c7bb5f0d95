"""The worker subprocesses the benchmark measures: what each system runs; starting, watching, stopping them.

It reads ``/proc`` for CPU time and resident set sizes; it sends no work and times no round.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.config import ROOT

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of one process so far (0 when it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rfind(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def status_kib(pid: int, field: str) -> int | None:
    """A KiB field of ``/proc/<pid>/status`` such as ``VmRSS`` (None when the process is gone or has no such field)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    return None


def celery_command(label: str, app: str, queue: str, concurrency: int, loglevel: str) -> list[str]:
    """The command line of a celery worker of ``app`` on ``queue`` with ``concurrency`` prefork processes."""
    command = [
        str(ROOT / ".venv" / "bin" / "celery"),
        "-A",
        app,
        "worker",
        "-P",
        "prefork",
        "-c",
        str(concurrency),
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
        "-Q",
        queue,
        "-n",
        f"{label}@%h",
        "-l",
        loglevel,
    ]
    if not Path(command[0]).exists():
        command[0:1] = [sys.executable, "-m", "celery"]
    return command


class Worker:
    """A worker subprocess (celery, or the DBOS peer's supervisor) in its own process group, stopped with it."""

    def __init__(self, label: str, command: list[str], env: dict[str, str], log: Path, cwd: Path = ROOT) -> None:
        self.label = label
        self.log = log
        self._log_file = log.open("wb")
        self.process = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=self._log_file, stderr=subprocess.STDOUT, start_new_session=True
        )

    def alive(self) -> bool:
        """Whether the main worker process is still running."""
        return self.process.poll() is None

    def children(self) -> list[int]:
        """Pids of the pool processes (direct children of the main worker process)."""
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2 :].split()
            if len(fields) > 1 and fields[1] == str(self.process.pid):
                found.append(int(entry.name))
        return sorted(found)

    def peak_rss_kib(self) -> dict[str, int]:
        """VmHWM (peak resident set) of the main process and each pool process, in KiB."""
        return self.memory_kib("VmHWM")

    def memory_kib(self, field: str) -> dict[str, int]:
        """A KiB field of ``/proc/<pid>/status`` of the main process and each pool process, by role.

        Roles are ``main`` and ``child <pid>``; ``field`` is ``VmRSS``, ``VmHWM``, ``RssAnon``...; processes gone
        or without the field are left out.
        """
        found = {}
        for role, pid in [("main", self.process.pid)] + [(f"child {pid}", pid) for pid in self.children()]:
            kib = status_kib(pid, field)
            if kib is not None:
                found[role] = kib
        return found

    def largest_rss_kib(self) -> int:
        """The largest VmHWM so far among the processes doing the work, in KiB (0 when none could be read).

        Those are the pool processes (or the DBOS serving processes); the main process when there are none.
        """
        peaks = self.peak_rss_kib()
        workers = [kib for role, kib in peaks.items() if role != "main"]
        return max(workers or peaks.values(), default=0)

    def cpu(self) -> dict[int, float]:
        """CPU seconds used so far by the main process and each pool process, by pid."""
        return {pid: cpu_seconds(pid) for pid in [self.process.pid, *self.children()]}

    def pause(self, paused: bool = True) -> None:
        """Stop (SIGSTOP) or continue (SIGCONT) the whole process group, so an idle worker costs the others nothing."""
        try:
            os.killpg(self.process.pid, signal.SIGSTOP if paused else signal.SIGCONT)
        except ProcessLookupError:
            pass

    def stop(self, grace_s: float = 10.0) -> None:
        """Warm shutdown of the whole process group (continued first if paused), then a kill if it lingers."""
        if self.alive():
            try:
                os.killpg(self.process.pid, signal.SIGCONT)
                os.killpg(self.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # pool processes left behind, if any
        except (ProcessLookupError, PermissionError):
            pass
        if self.process.poll() is None:
            self.process.wait(5)
        self._log_file.close()

    def tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the worker's log (empty when it cannot be read)."""
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class BenchError(RuntimeError):
    """The benchmark could not complete (a worker died, a round timed out, a run failed)."""


@dataclass(frozen=True)
class System:
    """One thing measured: a Lousho worker (of this tree or another one), the bare chain or the DBOS peer.

    With ``--events`` there is one Lousho worker of this tree per variant, told apart by ``env`` and ``watched``.
    """

    name: str
    kind: str  # "lousho", "bare" or "dbos"
    queue: str
    root: Path
    tag: str  # makes its run ids unique within a round
    env: tuple[tuple[str, str], ...] = ()  # added to its worker's environment
    watched: bool = False  # a consumer follows each of its runs' events (``bench.watch``)

    @property
    def app(self) -> str:
        """The Celery application its worker loads (``celery -A``)."""
        return "worker" if self.kind == "lousho" else "bench.bare"
