"""The worker side: agents, tools, the step machine and the Celery tasks that run steps.

``celery -A worker`` finds the app in ``worker.celery``; importing this package does not start
or configure Celery, so agent modules can ``from worker import Agent, tool`` cheaply. The error
family of ``store.errors`` is re-exported here as well (every class but the step machine's internal
``FencedOutError``).
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
from worker.agents import Agent, Tool, ToolContext, tool

__all__ = [
    "Agent",
    "AgentDriftError",
    "AgentNotFoundError",
    "ApprovalNotFoundError",
    "ApprovalOrphanedError",
    "CheckpointCorruptError",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "ConfigurationError",
    "InputTooLargeError",
    "LoushoError",
    "PropagatingToolError",
    "ProviderError",
    "ProviderRateLimitedError",
    "ResumeToolMissingError",
    "RunFailedError",
    "RunTimeoutError",
    "ScheduleBrokenError",
    "ScheduleNotFoundError",
    "SessionAwaitingApprovalError",
    "SessionBusyError",
    "SessionIdInvalidError",
    "StepAttemptsExceededError",
    "StorageError",
    "Tool",
    "ToolContext",
    "tool",
]
