"""Engine creation and migrations. Engines are made per process (after a fork), never at import."""

from __future__ import annotations

import os
import re
import select
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from psycopg.rows import dict_row, tuple_row
from sqlalchemy import Engine, TextClause, create_engine, event
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError, DisconnectionError
from sqlalchemy.pool import NullPool

from store import errors
from store.settings import Settings

MIGRATIONS = Path(__file__).parent / "migrations"


def make_engine(settings: Settings, *, pool_size: int = 2, pooled: bool = True) -> Engine:
    """A small pooled engine that replaces connections a restarted server closed, with no parameters in error text.

    ``pooled=False`` keeps no connection open between uses: for a process that forks while the
    engine lives (a prefork worker's parent), so no child ever inherits a connection.
    """
    options: dict[str, Any] = {"pool_size": pool_size, "max_overflow": 4}
    if not pooled:
        options = {"poolclass": NullPool}
    engine = create_engine(
        settings.sqlalchemy_url,
        hide_parameters=True,  # bound parameters are checkpoint contents: keep them out of errors
        connect_args=_connect_args(settings),
        **options,
    )
    if pooled:
        event.listen(engine, "checkout", _replace_if_closed)
    return engine


def _replace_if_closed(dbapi_connection: Any, record: Any, proxy: Any) -> None:
    """At checkout, without a round trip: a pooled connection the server has closed is replaced.

    An idle connection has nothing to read; when its socket is readable the server has closed it or sent
    its last message (a restart terminates every backend with a FATAL notice). Raising ``DisconnectionError``
    here makes the pool discard it and connect again (up to three times), which is what a pre-ping's
    ``SELECT 1`` would do at the cost of a round trip per checkout. A server that dies while a
    statement runs fails that statement, as it would with a pre-ping; the step is retried.
    """
    if _closed_by_server(dbapi_connection):
        raise DisconnectionError("the server closed or is closing this connection")


def _connect_args(settings: Settings) -> dict[str, Any]:
    """Connection options for psycopg: a connect timeout, our application name, prepared statements or none."""
    args: dict[str, Any] = {"connect_timeout": 5, "application_name": "lousho"}
    if not settings.database_prepared_statements:
        args["prepare_threshold"] = None  # never prepare: PgBouncer in transaction mode
    return args


def migrate(settings: Settings, revision: str = "head") -> None:
    """Bring the database schema to ``revision`` with Alembic (safe to run concurrently)."""
    from alembic import command

    command.upgrade(alembic_config(settings), revision)


def alembic_config(settings: Settings) -> Any:
    """Alembic's configuration (``alembic.config.Config``) of this project's migrations on ``settings``'s database."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.set_main_option("sqlalchemy.url", settings.sqlalchemy_url.replace("%", "%%"))
    return config


def ensure_database(settings: Settings) -> bool:
    """Create the database named in the URL if the server lacks it; True when it was created."""
    import psycopg
    from psycopg import sql

    url = settings.sqlalchemy_url.replace("postgresql+psycopg://", "postgresql://")
    base, _, query = url.partition("?")
    server, _, name = base.removeprefix("postgresql://").rpartition("/")
    server = "postgresql://" + server
    try:
        with psycopg.connect(url, connect_timeout=5):
            return False
    except psycopg.OperationalError as exc:
        if not name or "does not exist" not in str(exc):
            raise
    admin = f"{server}/postgres" + (f"?{query}" if query else "")
    with psycopg.connect(admin, autocommit=True, connect_timeout=5) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return True


class Transaction:
    """``engine.begin()`` that turns driver errors into ``StorageError`` (never leaking parameters)."""

    def __init__(self, engine: Engine) -> None:
        self._context = engine.begin()

    def __enter__(self) -> Connection:
        try:
            return self._context.__enter__()
        except DBAPIError as exc:
            raise errors.StorageError(f"database unavailable: {type(exc.orig).__name__}") from exc

    def __exit__(self, *exc_info: Any) -> None:
        try:
            self._context.__exit__(*exc_info)
        except DBAPIError as exc:
            raise errors.StorageError(f"database error: {type(exc.orig).__name__}") from exc
        if exc_info[0] is not None and issubclass(exc_info[0], DBAPIError):
            raise errors.StorageError(f"database error: {type(exc_info[1].orig).__name__}") from exc_info[1]


#: ``:name`` parameters of a ``text()`` statement (not ``::type`` casts).
_NAMED = re.compile(r"(?<![:\w]):(\w+)")


def driver_sql(statement: TextClause | str) -> str:
    """A ``text()`` statement in the driver's own parameter style, for ``direct`` connections."""
    sql = statement.text if isinstance(statement, TextClause) else statement
    return _NAMED.sub(r"%(\1)s", sql.replace("%", "%%"))


@contextmanager
def direct(engine: Engine) -> Iterator[psycopg.Connection[dict[str, Any]]]:
    """A pooled connection used through the driver alone, each statement its own transaction.

    For the step's hot path: the statements are prepared by the driver once used a few times, and the
    engine's execution layer (a few hundred microseconds of CPU per statement) is skipped. The
    connection comes from and returns to the engine's pool (same checkout check, same fork rules).
    Driver errors become ``StorageError`` without their parameters.

    Raises:
        StorageError: the database cannot be reached or refused a statement.
    """
    proxy = _check_out(engine)
    try:
        with _statements(proxy) as conn:
            yield conn
    finally:
        _check_in(proxy)


class Direct:
    """``direct`` connections of one engine, and a pin that keeps one of them for a thread's block of work.

    A step runs its claim, reads and saves inside ``pinned()``: one pooled connection for the whole step
    instead of a checkout per statement. Other threads (a batch's tool threads) and calls outside a pin
    check out their own. A pinned connection the server closed meanwhile (a long tool call across a
    Postgres restart) is noticed before its next statement, without a round trip, and replaced.
    """

    def __init__(self, engine: Engine, *, keep: bool = False) -> None:
        self.engine = engine
        self._local = threading.local()
        #: Whether the main thread keeps its pinned connection from one pin to the next (a worker process's steps:
        #: a checkout and a check-in less per step). The kept one stays checked out until the process ends.
        self.keep = keep
        #: The main thread's connection between two pins (pid, proxy).
        self._kept: tuple[int, Any] | None = None

    @contextmanager
    def pinned(self) -> Iterator[None]:
        """Keep one connection for this thread's statements until the block ends (nested pins share it)."""
        if getattr(self._local, "proxy", None) is not None:
            yield
            return
        kept, self._kept = self._kept, None
        if kept is not None and kept[0] != os.getpid():
            kept = None  # the parent's, before a fork: never used (nor checked in) here
        elif kept is not None and threading.current_thread() is not threading.main_thread():
            self._kept, kept = kept, None  # another thread's pin: it checks out its own
        self._local.proxy = kept[1] if kept is not None else None
        self._local.pinning = True
        try:
            yield
        finally:
            proxy, self._local.proxy, self._local.pinning = self._local.proxy, None, False
            if proxy is not None:
                conn = proxy.driver_connection
                if (
                    self.keep
                    and threading.current_thread() is threading.main_thread()
                    and self._kept is None
                    and conn is not None
                    and not (conn.broken or conn.closed)
                ):
                    self._kept = (os.getpid(), proxy)  # the next step's pin starts with it (checked before use)
                else:
                    _check_in(proxy)

    def release_kept(self) -> None:
        """Give the connection kept between pins back to the pool (before the engine is disposed)."""
        kept, self._kept = self._kept, None
        if kept is not None and kept[0] == os.getpid():
            _check_in(kept[1])

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection[dict[str, Any]]]:
        """This thread's pinned connection (checked out at its first use), or one of its own.

        Raises:
            StorageError: the database cannot be reached or refused a statement.
        """
        if not getattr(self._local, "pinning", False):
            with direct(self.engine) as own:
                yield own
            return
        proxy = self._local.proxy
        if proxy is not None and _closed_by_server(proxy.driver_connection):
            proxy.invalidate()
            self._unpin()
            proxy = None
        if proxy is None:
            proxy = self._local.proxy = _check_out(self.engine)
        with _statements(proxy, self._unpin) as conn:
            yield conn

    def _unpin(self) -> None:
        """Give back this thread's pinned connection (it broke): the next statement checks out another."""
        proxy, self._local.proxy = self._local.proxy, None
        if proxy is not None:
            _check_in(proxy)


@contextmanager
def _statements(proxy: Any, broke: Callable[[], None] | None = None) -> Iterator[psycopg.Connection[dict[str, Any]]]:
    """Statements on a checked-out ``direct`` connection; driver errors become ``StorageError``.

    A connection the error left unusable is invalidated (the pool drops it), then ``broke`` is called.
    """
    conn: psycopg.Connection[Any] = proxy.driver_connection
    try:
        yield conn
    except psycopg.Error as exc:
        if conn.broken or conn.closed:
            proxy.invalidate(exc)
            if broke is not None:
                broke()
        raise errors.StorageError(f"database error: {type(exc).__name__}") from exc


def _check_out(engine: Engine) -> Any:
    """A pooled connection, set up for ``direct`` use (autocommit, rows as dicts).

    Raises:
        StorageError: the database cannot be reached.
    """
    try:
        proxy = engine.raw_connection()
    except DBAPIError as exc:
        raise errors.StorageError(f"database unavailable: {type(exc.orig).__name__}") from exc
    conn: psycopg.Connection[Any] = proxy.driver_connection  # type: ignore[assignment]
    conn.autocommit = True
    conn.row_factory = dict_row
    return proxy


def _check_in(proxy: Any) -> None:
    """Give a ``direct`` connection back to the pool as the engine expects it (no autocommit)."""
    conn = proxy.driver_connection
    if conn is not None and not (conn.broken or conn.closed):
        conn.row_factory = tuple_row
        conn.autocommit = False
    proxy.close()


def _closed_by_server(conn: Any) -> bool:
    """Whether an idle connection is closed or being closed by the server (its socket is readable)."""
    if conn is None or conn.closed or conn.broken:
        return True
    try:
        readable, _, _ = select.select([conn.fileno()], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)
