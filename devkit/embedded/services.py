"""``EmbeddedServices``: the embedded Postgres and Redis of one project folder, started, reused and stopped.

It decides who may stop what (a process stops only the servers it started, unless asked to stop all of
the folder's) and holds the folder's lock around every start and stop. The servers' own details live in
``postgres_server`` and ``redis_server``.
"""

from __future__ import annotations

import shlex
import signal
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple, Protocol

from devkit.embedded import processes
from devkit.embedded.folder import ServerFolder
from devkit.embedded.postgres_server import POSTGRES, PREFERRED_POSTGRES_PORT, PostgresServer
from devkit.embedded.redis_server import PREFERRED_REDIS_PORT, REDIS, RedisServer


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


class _Server(Protocol):
    """What the services need of ``PostgresServer`` and ``RedisServer``."""

    name: str
    stop_signal: signal.Signals

    def running(self) -> processes.RunningServer | None: ...

    def orphan(self) -> Any | None: ...

    def url(self, port: int) -> str: ...


def default_root() -> Path:
    """The project folder whose ``.lousho/`` holds the data.

    Returns:
        The source checkout this module belongs to when it runs from one (an editable install),
        else the current directory.
    """
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file() and (checkout / "worker").is_dir():
        return checkout
    return Path.cwd()


class EmbeddedServices:
    """The embedded Postgres and Redis of one project folder.

    ``start`` is idempotent across processes: servers already running for this folder are reused.
    As a context manager it starts both and, on exit, stops only the servers it started itself
    (``release``), so nested users (``lousho dev`` in one terminal, ``lousho demo`` in another)
    do not pull the servers from under each other.
    """

    def __init__(
        self,
        root: Path | str | None = None,
        *,
        postgres_port: int | None = PREFERRED_POSTGRES_PORT,
        redis_port: int | None = PREFERRED_REDIS_PORT,
        durable: bool = True,
        startup_timeout: float = 60.0,
    ) -> None:
        """Describe the servers of ``root``; nothing starts until ``start``.

        Args:
            root: the project folder (data in ``root/.lousho``); ``default_root()`` when None.
            postgres_port: port tried first for a new Postgres (0 or None: any free port).
            redis_port: port tried first for a new Redis (0 or None: any free port).
            durable: False turns off fsync in both servers (throwaway test data only).
            startup_timeout: seconds to wait for a server to accept connections.
        """
        self.root = Path(root).resolve() if root is not None else default_root()
        self._folder = ServerFolder(self.root)
        self.home = self._folder.home
        self.postgres_port = postgres_port
        self.redis_port = redis_port
        self.durable = durable
        self.startup_timeout = startup_timeout
        self._started: set[str] = set()

    @property
    def _postgres(self) -> PostgresServer:
        return PostgresServer(self._folder, durable=self.durable, startup_timeout=self.startup_timeout)

    @property
    def _redis(self) -> RedisServer:
        return RedisServer(self._folder, durable=self.durable, startup_timeout=self.startup_timeout)

    @property
    def pg_dir(self) -> Path:
        """``.lousho/pg``: the cluster, its password and its log."""
        return self._postgres.dir

    @property
    def pg_data(self) -> Path:
        """The Postgres data directory."""
        return self._postgres.data

    @property
    def redis_dir(self) -> Path:
        """``.lousho/redis``: configuration, append-only file and log."""
        return self._redis.dir

    @property
    def started(self) -> frozenset[str]:
        """Names of the servers (``postgres``, ``redis``) that this object started."""
        return frozenset(self._started)

    def start_postgres(self) -> str:
        """Start this folder's Postgres, or reuse the one running; create the ``lousho`` database.

        Returns:
            The database URL (``postgresql://postgres:…@127.0.0.1:PORT/lousho``).

        Raises:
            EmbeddedError: the binaries are missing or the server did not come up (with its log).
        """
        server = self._postgres
        with self._folder.locked():
            running = server.running()
            if running is not None:
                return server.url(running.port)
            self._stop_orphan(server)
            url = server.launch(self.postgres_port)
            self._started.add(POSTGRES)
            return url

    def start_redis(self) -> str:
        """Start this folder's Redis (appendonly, noeviction), or reuse the one running.

        Returns:
            The Redis URL (``redis://:…@127.0.0.1:PORT/0``).

        Raises:
            EmbeddedError: no redis-server binary, or it did not come up (with its log).
        """
        server = self._redis
        with self._folder.locked():
            running = server.running()
            if running is not None:
                return server.url(running.port)
            self._stop_orphan(server)
            url = server.launch(self.redis_port)
            self._started.add(REDIS)
            return url

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

    def _stop_orphan(self, server: _Server) -> None:
        """Stop a server of this folder that no state names, so two never share one data folder."""
        process = server.orphan()
        if process is not None:
            processes.terminate(process.pid, server.stop_signal, timeout=20)

    def _stop_one(self, server: _Server) -> None:
        entry = self._folder.load_state().get(server.name, {})
        process = processes.find_process(entry.get("pid"), entry.get("created")) or server.orphan()
        if process is not None:
            processes.terminate(process.pid, server.stop_signal, timeout=20)
        self._folder.update_state(server.name, None)
        self._started.discard(server.name)

    def stop(self) -> None:
        """Stop both servers of this folder, whoever started them; their data stays."""
        with self._folder.locked():
            self._stop_one(self._redis)
            self._stop_one(self._postgres)

    def release(self) -> None:
        """Stop only the servers that this object started; servers it reused keep running."""
        if not self._started:
            return
        with self._folder.locked():
            for server in (self._redis, self._postgres):
                if server.name in self._started:
                    self._stop_one(server)

    def status(self) -> dict[str, ServiceStatus]:
        """What runs now for this folder.

        Returns:
            ``{"postgres": ServiceStatus, "redis": ServiceStatus}``.
        """
        result: dict[str, ServiceStatus] = {}
        servers: tuple[_Server, ...] = (self._postgres, self._redis)
        for server in servers:
            found = server.running() if self.home.exists() else None
            if found is None:
                result[server.name] = ServiceStatus(server.name, False, None, None, None)
            else:
                result[server.name] = ServiceStatus(server.name, True, found.pid, found.port, server.url(found.port))
        return result

    def processes(self) -> list[int]:
        """Pids of the running servers of this folder and of every process they forked."""
        pids: list[int] = []
        for entry in self._folder.load_state().values():
            pids += processes.family(entry.get("pid"), entry.get("created"))
        return pids

    def __enter__(self) -> ServiceURLs:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.release()


def exported(urls: ServiceURLs | dict[str, str]) -> str:
    """Shell lines that point another terminal at the servers.

    Args:
        urls: the two URLs, or a mapping of environment variables to export.

    Returns:
        ``export NAME='value'`` lines.
    """
    values = (
        {"LOUSHO_DATABASE_URL": urls.database_url, "LOUSHO_REDIS_URL": urls.redis_url}
        if isinstance(urls, ServiceURLs)
        else urls
    )
    return "\n".join(f"export {name}={shlex.quote(value)}" for name, value in values.items())
