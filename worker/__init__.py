"""The worker side: agents, tools, the step machine and the Celery tasks that run steps.

``celery -A worker`` finds the app in ``worker.celery``; importing this package does not start
or configure Celery, so agent modules can ``from worker import Agent, tool`` cheaply.
"""

from __future__ import annotations

from store.errors import (
    AgentDriftError,
    ApprovalOrphanedError,
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    ConfigurationError,
    LoushoError,
    ResumeToolMissingError,
    SessionAwaitingApprovalError,
    SessionBusyError,
    SessionIdInvalidError,
)
from worker.agents import Agent, Tool, ToolContext, tool

__all__ = [
    "Agent",
    "AgentDriftError",
    "ApprovalOrphanedError",
    "CheckpointCorruptError",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "ConfigurationError",
    "LoushoError",
    "ResumeToolMissingError",
    "SessionAwaitingApprovalError",
    "SessionBusyError",
    "SessionIdInvalidError",
    "Tool",
    "ToolContext",
    "tool",
]
