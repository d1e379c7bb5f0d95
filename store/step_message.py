"""The step message, owned in one place: its task name, arguments, routing and shared broker options.

The worker (after each step, and its dead-step watch) and the producer (new input) both send it; neither writes
its parts itself. Nothing here imports Celery: it says what a step message is, the senders send it.
"""

from __future__ import annotations

from typing import Any

from store import redis_client, telemetry
from store.settings import Settings

#: The task a run's step is sent as (``worker.tasks.advance``); senders that do not import the worker use the name.
ADVANCE = "lousho.advance"


def arguments(session_id: str, seq: int | None) -> dict[str, Any]:
    """The message's keyword arguments: the run and the seq it is for (None: whatever the run's next step is)."""
    return {"session_id": session_id, "seq": seq}


def reprs(session_id: str, seq: int | None) -> dict[str, str]:
    """What Flower and the task-sent event show of a step's arguments, as Celery's ``saferepr`` would show them.

    Made here: ``saferepr`` costs a tenth of a publish's CPU, for two short fields whose repr is known.
    """
    return {"argsrepr": "()", "kwargsrepr": f"{{'session_id': {session_id!r}, 'seq': {seq!r}}}"}


def routing(settings: Settings, agent: str | None, name: str | None = None, *, kind: str = "step") -> dict[str, Any]:
    """Where the message goes and what it is called: the agent's queue, and the step's name in Flower and logs.

    ``name`` wins when given (a message sent again keeps its name); otherwise ``"<agent>: <kind>"``.
    """
    return {"queue": settings.agent_queue(agent), "shadow": name or telemetry.step_name(agent, kind)}


def broker_options(settings: Settings) -> dict[str, Any]:
    """The Redis transport options of every app that sends or takes steps.

    One visibility timeout for all: on a shared Redis the shortest wins (celery#7651); and only late duplicates
    depend on it, recovery is the sweep's (celery#5935, kombu PR#2558). A Sentinel broker adds its master's name.

    Raises:
        ConfigurationError: a Sentinel broker without its master's name, or a malformed broker URL.
    """
    transport, _ = redis_client.celery_broker_options(settings)
    return {
        "visibility_timeout": settings.visibility_timeout_s,
        "unacked_restore_interval": 10,
        "unacked_restore_throttle": 1,
        "health_check_interval": 10,
        "socket_timeout": 15,
        "socket_connect_timeout": 5,
        "socket_keepalive": True,
        "retry_on_timeout": True,
        **transport,
    }


__all__ = ["ADVANCE", "arguments", "broker_options", "routing"]
