"""Durable state of Lousho Worker: records, the ports callers type against, their stores, errors.

The ports are ``store.interfaces``; Postgres and Redis implement them, ``store.memory`` for unit tests.
Imports neither Celery nor the worker or producer packages.
"""

from __future__ import annotations

from store.errors import (
    AgentDriftError,
    AgentNotFoundError,
    ApprovalNotFoundError,
    ApprovalOrphanedError,
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    ConfigurationError,
    InputTooLargeError,
    LeadGoneError,
    LoushoError,
    ProviderError,
    ReconcileFailedError,
    ResumeToolMissingError,
    RunTimeoutError,
    SessionAwaitingApprovalError,
    SessionBusyError,
    SessionIdInvalidError,
    StepAttemptsExceededError,
    StorageError,
)
from store.records import Checkpoint, HistoryEntry, Message, PendingRun, ToolCall, Usage
from store.settings import Settings

__all__ = [
    "AgentDriftError",
    "AgentNotFoundError",
    "ApprovalNotFoundError",
    "ApprovalOrphanedError",
    "Checkpoint",
    "CheckpointCorruptError",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "ConfigurationError",
    "HistoryEntry",
    "InputTooLargeError",
    "LeadGoneError",
    "LoushoError",
    "Message",
    "PendingRun",
    "ProviderError",
    "ReconcileFailedError",
    "ResumeToolMissingError",
    "RunTimeoutError",
    "SessionAwaitingApprovalError",
    "SessionBusyError",
    "SessionIdInvalidError",
    "Settings",
    "StepAttemptsExceededError",
    "StorageError",
    "ToolCall",
    "Usage",
]
