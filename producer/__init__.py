"""The producer side: ``Client`` and friends, used from any process to send runs and read results.

Re-exports the error family of ``store.errors`` (what the client's methods and ``Run.wait`` raise) and
``Limits``/``Prices`` (``resume(..., limits=...)``); defines nothing.
"""

from __future__ import annotations

from producer.client import AgentHandle, Approvals, Client, Run
from producer.forks import Fork
from producer.schedules import Schedules
from producer.trajectories import TrajectoryComparison, compare_trajectories
from store import errors
from store.errors import *  # noqa: F403  # the public errors, listed once in store.errors.__all__
from store.limits import Limits, Prices
from store.records import HistoryEntry, PendingRun
from store.summaries import RunPage, RunResult, RunSummary, WaitingOn

__all__ = [
    "AgentHandle",
    "Approvals",
    "Client",
    "Fork",
    "HistoryEntry",
    "Limits",
    "PendingRun",
    "Prices",
    "Run",
    "RunPage",
    "RunResult",
    "RunSummary",
    "Schedules",
    "TrajectoryComparison",
    "WaitingOn",
    "compare_trajectories",
]
__all__ += errors.__all__
