"""The worker side: agents, tools, the step machine and the Celery tasks that run steps.

``celery -A worker`` finds the app in ``worker.celery``; importing this package does not start
or configure Celery, so agent modules can ``from worker import Agent, tool`` cheaply. The error
family of ``store.errors`` is re-exported here as well (every class but the step machine's internal
``FencedOutError``), and so are ``Limits`` and ``Prices`` (``Agent(limits=..., prices=...)``),
``ModelLimit`` (``Agent(model_limit=...)``), ``SweptRun`` and
``LastError`` (what ``Agent(on_recovered=..., on_error=...)`` are called with), and ``install``
(``worker.celery.install``, which imports Celery only when called).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from store import errors
from store.errors import *  # noqa: F403  # the public errors, listed once in store.errors.__all__
from store.limits import Limits, Prices
from store.model_limit import ModelLimit
from store.records import LastError, SweptRun
from worker.agents import Agent, Tool, ToolContext, tool
from worker.dynamic import ResolveContext, RunConfig
from worker.hooks import Deny, HookContext, Input, ModelRequest, Result, RunEnd

if TYPE_CHECKING:
    from celery import Celery

    from store.settings import Settings


def install(app: Celery, settings: Settings | None = None) -> Celery:
    """Add Lousho to a team's own Celery ``app``, keeping everything the app had (``worker.celery.install``).

    Raises:
        ConfigurationError: the app's configuration breaks a guarantee that cannot be scoped to Lousho's tasks.
    """
    from worker import celery

    return celery.install(app, settings)


__all__ = [
    "Agent",
    "Deny",
    "HookContext",
    "Input",
    "LastError",
    "Limits",
    "ModelLimit",
    "ModelRequest",
    "Prices",
    "ResolveContext",
    "Result",
    "RunConfig",
    "RunEnd",
    "SweptRun",
    "Tool",
    "ToolContext",
    "install",
    "tool",
]
__all__ += errors.__all__
