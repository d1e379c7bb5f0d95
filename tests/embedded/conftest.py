"""Embedded-server tests: they start their own Postgres and Redis in a temporary folder.

They use neither ``LOUSHO_DATABASE_URL`` nor ``LOUSHO_REDIS_URL`` and never touch the machine's own
servers. Select them with ``-m embedded``.
"""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "embedded: starts the embedded Postgres and Redis of devkit.embedded")
