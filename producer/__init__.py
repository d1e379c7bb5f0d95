"""The producer side: ``Client`` and friends, used from any process to send runs and read results.

Re-exports the error family of ``store.errors`` (what the client's methods and ``Run.wait`` raise); defines nothing.
"""

from __future__ import annotations

from producer.client import AgentHandle, Approvals, Client, Run, RunResult
from producer.forks import Fork
from producer.schedules import Schedules
from producer.trajectories import TrajectoryComparison, compare_trajectories
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
    LoushoError,
    PropagatingToolError,
    ProviderError,
    ProviderRateLimitedError,
    ResumeToolMissingError,
    RunFailedError,
    RunTimeoutError,
    ScheduleBrokenError,
    ScheduleNotFoundError,
    SessionAwaitingApprovalError,
    SessionBusyError,
    SessionIdInvalidError,
    StepAttemptsExceededError,
    StorageError,
)
from store.records import HistoryEntry, PendingRun

__all__ = [
    "AgentDriftError",
    "AgentHandle",
    "AgentNotFoundError",
    "ApprovalNotFoundError",
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
    "PropagatingToolError",
    "ProviderError",
    "ProviderRateLimitedError",
    "ResumeToolMissingError",
    "Run",
    "RunFailedError",
    "RunResult",
    "RunTimeoutError",
    "ScheduleBrokenError",
    "ScheduleNotFoundError",
    "Schedules",
    "SessionAwaitingApprovalError",
    "SessionBusyError",
    "SessionIdInvalidError",
    "StepAttemptsExceededError",
    "StorageError",
    "TrajectoryComparison",
    "compare_trajectories",
]
