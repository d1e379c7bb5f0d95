"""Durable state of Lousho Worker: records, the ports callers type against, their stores, errors.

The ports are ``store.interfaces``; Postgres and Redis implement them, ``store.memory`` for unit tests.
Imports neither Celery nor the worker or producer packages.
"""

from __future__ import annotations

from store import errors
from store.errors import *  # noqa: F403  # the public errors, listed once in store.errors.__all__
from store.records import Checkpoint, HistoryEntry, Message, PendingRun, ToolCall, Usage
from store.settings import Settings

__all__ = [
    "Checkpoint",
    "HistoryEntry",
    "Message",
    "PendingRun",
    "Settings",
    "ToolCall",
    "Usage",
]
__all__ += errors.__all__
