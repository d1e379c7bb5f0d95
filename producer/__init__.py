"""The producer side: ``Client`` and friends, used from any process to send runs and read results."""

from __future__ import annotations

from producer.client import AgentHandle, Client, Run, RunResult
from store.errors import (
    AgentDriftError,
    AgentNotFoundError,
    ApprovalOrphanedError,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    ConfigurationError,
    InputTooLargeError,
    LoushoError,
    ResumeToolMissingError,
    RunTimeoutError,
    SessionAwaitingApprovalError,
    SessionBusyError,
    SessionIdInvalidError,
)
from store.records import HistoryEntry, PendingRun

__all__ = [
    "AgentDriftError",
    "AgentHandle",
    "AgentNotFoundError",
    "ApprovalOrphanedError",
    "CheckpointCorruptError",
    "CheckpointNotFoundError",
    "Client",
    "ConfigurationError",
    "HistoryEntry",
    "InputTooLargeError",
    "LoushoError",
    "PendingRun",
    "ResumeToolMissingError",
    "Run",
    "RunResult",
    "RunTimeoutError",
    "SessionAwaitingApprovalError",
    "SessionBusyError",
    "SessionIdInvalidError",
]
