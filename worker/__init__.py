"""The worker side: agents, tools, the step machine and the Celery tasks that run steps.

``celery -A worker`` finds the app in ``worker.celery``; importing this package does not start
or configure Celery, so agent modules can ``from worker import Agent, tool`` cheaply. The error
family of ``store.errors`` is re-exported here as well (every class but the step machine's internal
``FencedOutError``), and so are ``Limits`` and ``Prices`` (``Agent(limits=..., prices=...)``), and ``SweptRun`` and
``LastError``, what ``Agent(on_recovered=..., on_error=...)`` are called with.
"""

from __future__ import annotations

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
from store.records import LastError, SweptRun
from worker.agents import Agent, Tool, ToolContext, tool
from worker.dynamic import ResolveContext, RunConfig
from worker.hooks import Deny, HookContext, Input, ModelRequest, Result, RunEnd

__all__ = [
    "Agent",
    "AgentDriftError",
    "AgentNotFoundError",
    "ApprovalExpiredError",
    "ApprovalNotFoundError",
    "ApprovalOrphanedError",
    "CheckpointCorruptError",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "ConfigResolverError",
    "ConfigurationError",
    "Deny",
    "HookContext",
    "HookFailedError",
    "Input",
    "InputTooLargeError",
    "LastError",
    "LeadGoneError",
    "Limits",
    "LoushoError",
    "ModelRequest",
    "Prices",
    "PropagatingToolError",
    "ProviderError",
    "ProviderRateLimitedError",
    "ResolveContext",
    "Result",
    "ResumeToolMissingError",
    "RunConfig",
    "RunEnd",
    "RunFailedError",
    "RunTimeoutError",
    "ScheduleBrokenError",
    "ScheduleNotFoundError",
    "SessionAwaitingApprovalError",
    "SessionBusyError",
    "SessionIdInvalidError",
    "StepAttemptsExceededError",
    "StorageError",
    "SweptRun",
    "Tool",
    "ToolContext",
    "tool",
]
