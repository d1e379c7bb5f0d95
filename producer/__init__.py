"""The producer side: ``Client`` and friends, used from any process to send runs and read results."""

from __future__ import annotations

from producer.client import AgentHandle, Approvals, Client, Run, RunResult
from producer.forks import Fork
from producer.schedules import Schedules
from producer.trajectories import TrajectoryComparison, compare_trajectories
from store.errors import (
    AgentDriftError,
    AgentNotFoundError,
    ApprovalOrphanedError,
    CheckpointCorruptError,
    CheckpointFormatError,
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
    "Approvals",
    "CheckpointCorruptError",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "Client",
    "ConfigurationError",
    "Fork",
    "HistoryEntry",
    "InputTooLargeError",
    "LoushoError",
    "PendingRun",
    "ResumeToolMissingError",
    "Run",
    "RunResult",
    "RunTimeoutError",
    "Schedules",
    "SessionAwaitingApprovalError",
    "SessionBusyError",
    "SessionIdInvalidError",
    "TrajectoryComparison",
    "compare_trajectories",
]
