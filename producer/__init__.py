"""The producer side: ``Client`` and friends, used from any process to send runs and read results.

Re-exports the error family of ``store.errors`` (what the client's methods and ``Run.wait`` raise) and
``Limits``/``Prices`` (``resume(..., limits=...)``); defines nothing.
"""

from __future__ import annotations

from producer.client import AgentHandle, Approvals, Client, Run, RunResult
from producer.forks import Fork
from producer.schedules import Schedules
from producer.trajectories import TrajectoryComparison, compare_trajectories
from store.errors import (
    AgentDriftError,
    AgentNotFoundError,
    ApprovalExpiredError,
    ApprovalNotFoundError,
    ApprovalOrphanedError,
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    ConfigResolverError,
    ConfigurationError,
    HookFailedError,
    InputTooLargeError,
    LeadGoneError,
    LoushoError,
    PropagatingToolError,
    ProviderError,
    ProviderRateLimitedError,
    ReconcileFailedError,
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
from store.limits import Limits, Prices
from store.records import HistoryEntry, PendingRun
from store.summaries import RunPage, RunSummary, WaitingOn

__all__ = [
    "AgentDriftError",
    "AgentHandle",
    "AgentNotFoundError",
    "ApprovalExpiredError",
    "ApprovalNotFoundError",
    "ApprovalOrphanedError",
    "Approvals",
    "CheckpointCorruptError",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "Client",
    "ConfigResolverError",
    "ConfigurationError",
    "Fork",
    "HistoryEntry",
    "HookFailedError",
    "InputTooLargeError",
    "LeadGoneError",
    "Limits",
    "LoushoError",
    "PendingRun",
    "Prices",
    "PropagatingToolError",
    "ProviderError",
    "ProviderRateLimitedError",
    "ReconcileFailedError",
    "ResumeToolMissingError",
    "Run",
    "RunFailedError",
    "RunPage",
    "RunResult",
    "RunSummary",
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
    "WaitingOn",
    "compare_trajectories",
]
