"""Spend budgets of a run's input: which limits apply, whether they are spent, and the run's clock.

``max_duration_s`` is measured on Postgres's clock (each step starts from the time of its claim), counting
only while the run runs: the clock stops with a save that pauses, finishes or stops the run, and starts
again with the next step that calls the model or runs tools. A follow-up starts it from zero.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from pydantic import ValidationError

from store import errors
from store.limits import Limits, Prices
from store.records import Checkpoint, Usage
from worker.agents import Agent

__all__ = ["checker", "clock_running", "clock_stopped", "elapsed_s", "limits_of", "spent"]


def limits_of(agent: Agent, checkpoint: Checkpoint) -> Limits | None:
    """The limits the run's input is under: those given to ``resume``, else the agent's.

    Raises:
        ConfigurationError: the stored limits cannot be read, or ``max_cost`` has no prices to count with.
    """
    limits = agent.limits
    if checkpoint.limits is not None:
        try:
            limits = Limits(**checkpoint.limits)
        except (ValidationError, TypeError) as exc:
            raise errors.ConfigurationError(
                f"the limits stored with run {checkpoint.session_id!r} cannot be read: {exc}", field="limits"
            ) from None
    if limits is not None and limits.max_cost is not None and agent.prices is None:
        raise errors.ConfigurationError(
            f"run {checkpoint.session_id!r} has a max_cost, but agent {agent.name!r}"
            " has no prices to count it with (Agent(..., prices=Prices(...)))",
            field="limits",
        )
    return limits


def elapsed_s(checkpoint: Checkpoint, now: datetime) -> float:
    """Seconds the run's input has been running as of ``now``."""
    spent_s = checkpoint.clock_spent_s or 0.0
    if checkpoint.clock_since is not None:
        spent_s += max((now - checkpoint.clock_since).total_seconds(), 0.0)
    return spent_s


def spent(limits: Limits, prices: Prices | None, checkpoint: Checkpoint, now: datetime) -> str | None:
    """The first limit ``checkpoint`` has reached, by name, or None."""
    usage = checkpoint.usage
    if limits.max_input_tokens is not None and usage.input_tokens >= limits.max_input_tokens:
        return "max_input_tokens"
    if limits.max_output_tokens is not None and usage.output_tokens >= limits.max_output_tokens:
        return "max_output_tokens"
    if limits.max_cost is not None and prices is not None and prices.cost(usage) >= limits.max_cost:
        return "max_cost"
    if limits.max_duration_s is not None and elapsed_s(checkpoint, now) >= limits.max_duration_s:
        return "max_duration_s"
    return None


def checker(
    limits: Limits | None, prices: Prices | None, now: datetime, in_flight: Callable[[], Usage] | None = None
) -> Callable[[Checkpoint], bool] | None:
    """What ``machine.plan`` asks before a model call: has the input spent a limit? None without limits.

    ``in_flight``: what the run's children still running spent so far (their usage is the run's only once their
    results are recorded), counted too.
    """
    if limits is None:
        return None

    def over(checkpoint: Checkpoint) -> bool:
        if in_flight is not None:
            checkpoint = checkpoint.model_copy(update={"usage": checkpoint.usage + in_flight()})
        return spent(limits, prices, checkpoint, now) is not None

    return over


def clock_running(checkpoint: Checkpoint, now: datetime) -> Checkpoint:
    """``checkpoint`` with its clock running (started at ``now`` if it was stopped)."""
    if checkpoint.clock_since is not None:
        return checkpoint
    return checkpoint.model_copy(update={"clock_since": now, "clock_spent_s": checkpoint.clock_spent_s or 0.0})


def clock_stopped(checkpoint: Checkpoint, now: datetime) -> Checkpoint:
    """``checkpoint`` with its clock stopped at ``now`` (the time run so far kept in ``clock_spent_s``)."""
    if checkpoint.clock_since is None:
        return checkpoint
    return checkpoint.model_copy(update={"clock_spent_s": round(elapsed_s(checkpoint, now), 3), "clock_since": None})
