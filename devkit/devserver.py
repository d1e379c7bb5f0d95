"""``lousho dev``: services, a worker and beat for local development, in one foreground command.

This module owns choosing the services for a development process (the ones named by
``LOUSHO_DATABASE_URL`` / ``LOUSHO_REDIS_URL``, else the embedded servers of ``devkit.embedded``),
migrating the database, running ``celery -A worker worker`` and ``celery -A worker beat`` (and Flower
on request) as child processes (through ``devkit.supervisor``), and shutting all of them down on Ctrl-C
or SIGTERM: SIGTERM to the children, SIGKILL after a timeout, then the embedded servers it started.

It must not keep durable state of its own, change how steps run, or stop a server it did not start
(configured services, or embedded ones another process started and still uses).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import IO, Any

from devkit.embedded import EmbeddedServices, default_root, exported
from devkit.supervisor import Child, Supervisor
from store import redaction
from store.database import ensure_database, migrate
from store.settings import Settings

DEFAULT_AGENTS = "examples.shop"
_URL_VARIABLES = ("LOUSHO_DATABASE_URL", "LOUSHO_REDIS_URL")


@dataclass
class Services:
    """The services a development process uses, and the embedded servers started for it."""

    settings: Settings
    embedded: EmbeddedServices | None = None
    #: Which embedded servers are in use (``postgres``, ``redis``), started here or reused.
    embedded_names: set[str] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)

    def release(self) -> None:
        """Stop the embedded servers that were started for this process (reused ones keep running)."""
        if self.embedded is not None:
            self.embedded.release()


def resolve_services(
    environ: Mapping[str, str] | None = None, *, root: Path | None = None, durable: bool = True
) -> Services:
    """Settings for the configured services, starting embedded servers for the ones not configured.

    Args:
        environ: the environment to read (``os.environ`` when None).
        root: project folder of the embedded servers' data (``.lousho/``); ``default_root()`` when None.
        durable: False runs new embedded servers without fsync (throwaway data).

    Returns:
        ``Services``: ``settings`` name the services; ``embedded`` is set when any embedded server is
        used, and ``release()`` stops those started here.

    Raises:
        devkit.embedded.EmbeddedError: an embedded server could not be started.
    """
    env = dict(os.environ if environ is None else environ)
    database_url = env.get("LOUSHO_DATABASE_URL")
    redis_url = env.get("LOUSHO_REDIS_URL")
    if database_url and redis_url:
        return Services(Settings(database_url=database_url, redis_url=redis_url))
    embedded = EmbeddedServices(root, durable=durable)
    names: set[str] = set()
    notes = []
    try:
        if not database_url:
            database_url = embedded.start_postgres()
            names.add("postgres")
            notes.append(f"PostgreSQL: embedded, data in {embedded.pg_dir}")
        if not redis_url:
            redis_url = embedded.start_redis()
            names.add("redis")
            notes.append(f"Redis: embedded, data in {embedded.redis_dir}")
        settings = Settings(database_url=database_url, redis_url=redis_url)
    except BaseException:
        embedded.release()
        raise
    return Services(settings, embedded, names, notes)


@contextlib.contextmanager
def dev_services(
    environ: Mapping[str, str] | None = None, *, root: Path | None = None, durable: bool = True
) -> Iterator[Settings]:
    """Settings naming usable services for the duration of a ``with`` block (``lousho demo`` uses it).

    The configured services when ``LOUSHO_DATABASE_URL`` and ``LOUSHO_REDIS_URL`` are set, else the
    embedded servers, started (or reused) on entry; on exit the ones started here are stopped.

    Args:
        environ: the environment to read (``os.environ`` when None).
        root: project folder of the embedded servers' data; ``default_root()`` when None.
        durable: False runs new embedded servers without fsync.

    Yields:
        ``Settings`` with the database and Redis URLs filled in (other fields from the environment).
    """
    services = resolve_services(environ, root=root, durable=durable)
    try:
        yield services.settings
    finally:
        services.release()


def stop_services(root: Path | None = None) -> None:
    """Stop the embedded servers of ``root`` left running (``lousho dev --stop``).

    Args:
        root: the project folder; ``default_root()`` when None.
    """
    EmbeddedServices(root).stop()


def _pythonpath(root: Path, env: Mapping[str, str]) -> str:
    existing = env.get("PYTHONPATH", "")
    return str(root) + (os.pathsep + existing if existing else "")


def run_dev(
    settings: Settings | None = None,
    *,
    root: Path | None = None,
    concurrency: int = 2,
    flower: bool = False,
    flower_port: int = 5555,
    keep_services: bool = False,
    stop_timeout: float = 20.0,
    out: IO[str] | None = None,
) -> int:
    """Run the services, a worker and beat in the foreground until Ctrl-C or SIGTERM.

    Args:
        settings: the services to use; None reads ``LOUSHO_DATABASE_URL`` / ``LOUSHO_REDIS_URL`` and
            starts embedded servers for the ones not set.
        root: the project folder: children's working directory and home of ``.lousho/``.
        concurrency: worker processes of the Celery worker.
        flower: also run Flower on 127.0.0.1 with basic auth (``FLOWER_BASIC_AUTH=user:password``, or
            a generated password that is printed); needs the ``flower`` package.
        flower_port: Flower's port.
        keep_services: leave the embedded servers started here running on exit.
        stop_timeout: seconds the children get to stop after SIGTERM before SIGKILL.
        out: where to print (stdout when None).

    Returns:
        0 after Ctrl-C or SIGTERM, 1 when a child exited on its own (everything is stopped either way).
    """
    redaction.install()
    out = out or sys.stdout
    root = (root or default_root()).resolve()

    def say(text: str = "") -> None:
        with contextlib.suppress(OSError, ValueError):  # a closed terminal must not stop the shutdown
            print(text, file=out, flush=True)

    stopping: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        stopping.append(signum)
        if len(stopping) > 1:
            say("[dev] second signal: killing the children now")

    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, on_signal) for sig in handled}
    services: Services | None = None
    supervisor: Supervisor | None = None
    try:
        services = _choose_services(settings, root, say)
        supervisor, agents = _prepare(services, root)
        if not stopping:
            _start_children(
                supervisor, services, agents, concurrency=concurrency, flower=flower, flower_port=flower_port, say=say
            )
        return _watch(supervisor, stopping, say)
    finally:
        try:
            if supervisor is not None:
                say(f"[dev] stopping {', '.join(child.name for child in supervisor.children) or 'nothing'}")
                supervisor.stop(stop_timeout, hurry=lambda: len(stopping) > 1)
        finally:
            try:
                if services is not None:
                    _release(services, keep_services, say)
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)


def _choose_services(settings: Settings | None, root: Path, say: Any) -> Services:
    if settings is not None:
        return Services(settings)
    if not all(os.environ.get(name) for name in _URL_VARIABLES):
        say(f"[dev] starting embedded PostgreSQL and Redis (data in {root / '.lousho'})")
    return resolve_services(root=root)


def _prepare(services: Services, root: Path) -> tuple[Supervisor, str]:
    """Create and migrate the database; returns the children's supervisor and the agents they load."""
    settings = services.settings
    ensure_database(settings)
    migrate(settings)
    (root / ".lousho").mkdir(exist_ok=True)
    agents = settings.agents or (DEFAULT_AGENTS if (root / "examples" / "shop.py").is_file() else "")
    env = {
        **os.environ,
        "LOUSHO_DATABASE_URL": settings.database_url,
        "LOUSHO_REDIS_URL": settings.redis_url,
        "LOUSHO_AGENTS": agents,
        "PYTHONPATH": _pythonpath(root, os.environ),
    }
    return Supervisor(root, env), agents


def _start_children(
    supervisor: Supervisor,
    services: Services,
    agents: str,
    *,
    concurrency: int,
    flower: bool,
    flower_port: int,
    say: Any,
) -> None:
    home = supervisor.root / ".lousho"
    worker = supervisor.spawn(
        "worker", ["worker", "-c", str(concurrency), "--loglevel", "INFO", "--without-gossip", "--without-mingle"]
    )
    beat = supervisor.spawn("beat", ["beat", "-s", str(home / "celerybeat-schedule"), "--loglevel", "INFO"])
    flower_line = _start_flower(supervisor, flower_port) if flower else ""
    _banner(say, services, agents, worker, beat, flower_line, concurrency)


def _start_flower(supervisor: Supervisor, port: int) -> str:
    """Start Flower with basic auth when it is installed; returns the banner's line about it."""
    if find_spec("flower") is None:
        return "  flower    not installed (pip install 'lousho-worker[flower]')"
    auth = os.environ.get("FLOWER_BASIC_AUTH") or f"lousho:{secrets.token_urlsafe(12)}"
    # The columns that show a step: its name (agent and kind), kwargs (run id and seq), result and exception.
    columns = "--tasks_columns=name,uuid,state,kwargs,result,exception,received,runtime,worker"
    supervisor.spawn(
        "flower", ["flower", "--address=127.0.0.1", f"--port={port}", columns], {"FLOWER_BASIC_AUTH": auth}
    )
    user, _, password = auth.partition(":")
    return (
        f"  flower    http://127.0.0.1:{port}  (user {user}, password "
        f"{password if 'FLOWER_BASIC_AUTH' not in os.environ else 'from FLOWER_BASIC_AUTH'})"
    )


def _watch(supervisor: Supervisor, stopping: list[int], say: Any) -> int:
    """Wait for a signal (0) or for a child to exit on its own (1)."""
    while not stopping:
        crashed = supervisor.exited()
        if crashed is not None:
            say(f"[dev] {crashed.name} exited with status {crashed.process.returncode}: stopping everything")
            return 1
        time.sleep(0.2)
    return 0


def _release(services: Services, keep_services: bool, say: Any) -> None:
    if services.embedded is None:
        return
    started = services.embedded.started
    if keep_services:
        if started:
            say("[dev] embedded servers left running; stop them with: lousho dev --stop")
        return
    if started:
        services.release()
        say(f"[dev] stopped the embedded {' and '.join(sorted(started))}")
    reused = services.embedded_names - started
    if reused:
        say(
            f"[dev] left running the embedded {' and '.join(sorted(reused))} that another process started; "
            "stop with: lousho dev --stop"
        )


def _banner(
    say: Any, services: Services, agents: str, worker: Child, beat: Child, flower_line: str, concurrency: int
) -> None:
    settings = services.settings
    say("")
    say("Lousho dev")
    say(f"  database  {_hide_password(settings.database_url)}")
    say(f"  redis     {_hide_password(settings.redis_url)}")
    for note in services.notes:
        say(f"            {note}")
    say(f"  agents    {agents or '(none: set LOUSHO_AGENTS)'}")
    say(f"  worker    pid {worker.process.pid} (concurrency {concurrency})    beat  pid {beat.process.pid}")
    if flower_line:
        say(flower_line)
    say("")
    say("Point another terminal at the same services:")
    # The URLs of embedded servers are printed whole (their generated passwords are the only way in); a
    # configured URL is the caller's own secret and is never printed.
    urls = {
        "LOUSHO_DATABASE_URL": (settings.database_url, "postgres"),
        "LOUSHO_REDIS_URL": (settings.redis_url, "redis"),
    }
    shown = {name: url for name, (url, server) in urls.items() if server in services.embedded_names}
    for line in exported({**shown, **({"LOUSHO_AGENTS": agents} if agents else {})}).splitlines():
        say(f"  {line}")
    for name in urls:
        if name not in shown:
            say(f"  # {name}: as set in this shell")
    if agents == DEFAULT_AGENTS:
        say('  lousho send shop "Reserve two teas, charge 5 and ship order 7" --session order-7 --wait')
    say("")
    say("Ctrl-C stops the worker and beat" + (" and the embedded servers." if services.embedded else "."))
    say("")


def _hide_password(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    credentials, at, host = rest.rpartition("@")
    if not sep or not at or ":" not in credentials:
        return url
    user = credentials.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}"
