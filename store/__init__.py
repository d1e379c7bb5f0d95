"""Durable state of Lousho Worker, and the kernel every package shares.

Durable state: the records (pure), the ports callers type against (``store.interfaces``, pure), and the stores
that implement them: Postgres, Redis, and ``store.memory`` for unit tests. The kernel: settings, errors,
telemetry, metrics, logs, redaction, crash points and the step message. docs/architecture.md maps each module to
its kind and tables. Imports neither Celery nor the worker, producer or devkit packages.
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
