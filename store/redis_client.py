"""Redis connections for the leases, the signals and the broker: plain, TLS, with a password, or through Sentinel.

One URL (``LOUSHO_REDIS_URL``, and ``LOUSHO_BROKER_URL`` when the broker is elsewhere) in kombu's grammar, so the
leases and Celery always agree on where Redis is:

- ``redis://[:password@]host:port/db``: a plain connection (``redis://user:password@...`` with an ACL user).
- ``rediss://[:password@]host:port/db?ssl_ca_certs=/ca.pem``: TLS. ``ssl_cert_reqs`` is ``required`` (the
  default), ``optional`` or ``none``; ``ssl_certfile`` and ``ssl_keyfile`` give a client certificate.
- ``sentinel://[:password@]host:26379/db;sentinel://host2:26379;...`` with ``LOUSHO_REDIS_SENTINEL_MASTER``: the
  master Sentinel names, found again after a failover. The URL's password is the master's;
  ``LOUSHO_REDIS_SENTINEL_PASSWORD`` is the Sentinel nodes' own, when they have one.

What a failover does to runs: a lease lives in the master's memory, so a failover can lose leases that were not
replicated yet, and the new master can hand a run to a second worker while the first still works on it. Saves stay
safe: every save is fenced in Postgres, and the fence counter is raised above Postgres's when Redis lost it, so the
late holder's save is refused and leaves no trace. What can happen twice is what was in flight at that moment (the
calls of the run's current tool batch without a recorded result), as after any lost lease.
"""

from __future__ import annotations

import functools
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeAlias, TypeVar
from urllib.parse import parse_qs, unquote, urlsplit

import redis
from redis.sentinel import Sentinel

from store import errors
from store.settings import Settings

#: A Redis client as the store builds it (``connect``): code outside ``store`` names its type by this, and never
#: imports redis itself.
Client: TypeAlias = redis.Redis

_P = ParamSpec("_P")
_T = TypeVar("_T")


def translated(call: Callable[_P, _T]) -> Callable[_P, _T]:
    """``call`` with Redis's errors raised as ``StorageError`` (the cause kept), as every store error is."""

    @functools.wraps(call)
    def translating(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        try:
            return call(*args, **kwargs)
        except redis.RedisError as exc:
            raise errors.StorageError(f"Redis unavailable: {type(exc).__name__}") from exc

    return translating


_CERT_REQS = {"required": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL, "none": ssl.CERT_NONE}
_TLS_FILES = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")


@dataclass(frozen=True)
class SentinelURL:
    """A ``sentinel://`` URL taken apart: the Sentinel nodes, and the master's database and credentials."""

    nodes: tuple[tuple[str, int], ...]
    db: int = 0
    username: str | None = None
    password: str | None = None


def is_sentinel(url: str) -> bool:
    """Whether ``url`` names Sentinel nodes rather than a Redis server."""
    return url.startswith("sentinel://")


def parse_sentinel(url: str) -> SentinelURL:
    """The nodes, database and master credentials of a ``sentinel://host:port[;sentinel://host:port...]/db`` URL.

    Raises:
        ConfigurationError: a part is not a ``sentinel://host[:port]`` URL (the message never repeats a password).
    """
    nodes: list[tuple[str, int]] = []
    db, username, password = 0, None, None
    for part in (p.strip() for p in url.split(";")):
        if not part:
            continue
        split = urlsplit(part)
        if split.scheme != "sentinel" or not split.hostname:
            raise errors.ConfigurationError("a Sentinel URL is sentinel://host:port[;sentinel://host:port...]/db")
        try:
            nodes.append((split.hostname, split.port or 26379))
        except ValueError:
            raise errors.ConfigurationError("a Sentinel node's port is not a number") from None
        if split.password is not None and password is None:
            username, password = (unquote(split.username) if split.username else None), unquote(split.password)
        path = split.path.strip("/")
        if path:
            if not path.isdigit():
                raise errors.ConfigurationError("a Sentinel URL's database is a number (sentinel://host:port/0)")
            db = int(path)
    if not nodes:
        raise errors.ConfigurationError("a Sentinel URL names at least one node")
    return SentinelURL(tuple(nodes), db, username, password)


def tls_options(url: str) -> dict[str, Any] | None:
    """The TLS options of a ``rediss://`` URL's query (``ssl_cert_reqs`` and the certificate files), else None.

    Raises:
        ConfigurationError: ``ssl_cert_reqs`` is not ``required``, ``optional`` or ``none``.
    """
    split = urlsplit(url)
    if split.scheme != "rediss":
        return None
    query = {key: values[-1] for key, values in parse_qs(split.query).items()}
    reqs = query.get("ssl_cert_reqs", "required").lower().removeprefix("cert_")
    if reqs not in _CERT_REQS:
        raise errors.ConfigurationError("ssl_cert_reqs in a rediss:// URL is required, optional or none")
    options: dict[str, Any] = {"ssl_cert_reqs": _CERT_REQS[reqs]}
    options.update((name, query[name]) for name in _TLS_FILES if query.get(name))
    return options


def connect(settings: Settings, url: str | None = None, **options: Any) -> redis.Redis:
    """A client of the Redis at ``url`` (``settings.redis_url`` by default), through Sentinel when it says so.

    ``options`` are redis-py connection options (timeouts, ``health_check_interval``).

    Raises:
        ConfigurationError: a Sentinel URL without ``LOUSHO_REDIS_SENTINEL_MASTER``, or a malformed URL.
    """
    url = url or settings.redis_url
    if not is_sentinel(url):
        return redis.Redis.from_url(url, **options)
    master, parsed = _sentinel(settings, url)
    sentinel = Sentinel(  # type: ignore[no-untyped-call,unused-ignore]  # redis-py's Sentinel is not annotated
        list(parsed.nodes), sentinel_kwargs=sentinel_kwargs(settings, options), **options
    )
    client: redis.Redis = sentinel.master_for(  # type: ignore[no-untyped-call,unused-ignore]
        master, redis_class=redis.Redis, db=parsed.db, username=parsed.username, password=parsed.password
    )
    return client


def _sentinel(settings: Settings, url: str) -> tuple[str, SentinelURL]:
    """The master's name and the parsed ``sentinel://`` URL.

    Raises:
        ConfigurationError: no ``LOUSHO_REDIS_SENTINEL_MASTER``, or a malformed URL.
    """
    if not settings.redis_sentinel_master:
        raise errors.ConfigurationError("a sentinel:// Redis URL needs LOUSHO_REDIS_SENTINEL_MASTER (the master name)")
    return settings.redis_sentinel_master, parse_sentinel(url)


def sentinel_kwargs(settings: Settings, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Connection options for the Sentinel nodes themselves (their password, and the caller's timeouts)."""
    kwargs = {
        key: value for key, value in (options or {}).items() if key in ("socket_timeout", "socket_connect_timeout")
    }
    if settings.redis_sentinel_password is not None and settings.redis_sentinel_password.get_secret_value():
        kwargs["password"] = settings.redis_sentinel_password.get_secret_value()
    return kwargs


def celery_broker_options(settings: Settings) -> tuple[dict[str, Any], dict[str, Any]]:
    """What Celery needs for ``settings.broker`` beyond its URL: ``(transport options, other settings)``.

    A Sentinel broker gets ``master_name`` and ``sentinel_kwargs``; a ``rediss://`` one gets ``broker_use_ssl``.

    Raises:
        ConfigurationError: a Sentinel broker without ``LOUSHO_REDIS_SENTINEL_MASTER``, or a malformed URL.
    """
    broker = settings.broker
    if is_sentinel(broker):
        transport: dict[str, Any] = {"master_name": _sentinel(settings, broker)[0]}
        kwargs = sentinel_kwargs(settings)
        if kwargs:
            transport["sentinel_kwargs"] = kwargs
        return transport, {}
    tls = tls_options(broker)
    return {}, ({"broker_use_ssl": tls} if tls is not None else {})


__all__ = [
    "Client",
    "SentinelURL",
    "celery_broker_options",
    "connect",
    "is_sentinel",
    "parse_sentinel",
    "sentinel_kwargs",
    "tls_options",
    "translated",
]
