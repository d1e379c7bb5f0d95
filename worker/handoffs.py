"""Handoffs: a run moved from one agent to another by a ``transfer_to_<name>`` call.

The run keeps its row, its id and its agent (the one it was sent to); ``Checkpoint.active_agent`` names the
agent it is on now, and every later step and resume runs as that agent: its model, tools and instructions
(its instructions replace the saved system message in each request). What belongs to the run stays the
entry agent's: its hooks, limits and prices, its step budget (counted across agents), its drift policy and
its limit on handoffs.
"""

from __future__ import annotations

from collections.abc import Mapping

from store.records import Checkpoint, Message
from worker.agents import HANDOFF_PREFIX, Agent

__all__ = ["agent_for", "as_target", "handoffs_in_input", "instructed", "target_of"]


def _find(entry: Agent, name: str, agents: Mapping[str, Agent]) -> Agent | None:
    """The agent named ``name``: registered with the worker, or reachable through ``entry``'s handoffs."""
    found = agents.get(name)
    if found is not None:
        return found
    seen, todo = {entry.name}, list(entry.handoffs.values())
    while todo:
        candidate = todo.pop()
        if candidate.name == name:
            return candidate
        if candidate.name not in seen:
            seen.add(candidate.name)
            todo.extend(candidate.handoffs.values())
    return None


_handed: dict[tuple[int, int], Agent] = {}


def as_target(entry: Agent, target: Agent) -> Agent:
    """``target`` with what belongs to the run taken from ``entry`` (built once per pair in a process)."""
    key = (id(entry), id(target))
    cached = _handed.get(key)
    if cached is not None:
        return cached
    handed = target.replace(
        max_steps=entry.max_steps,
        on_agent_drift=entry.on_agent_drift,
        hooks=entry.hooks,
        limits=entry.limits,
        prices=entry.prices,
        approval_expires_in=entry.approval_expires_in,
        max_handoffs=entry.max_handoffs,
    )
    _handed[key] = handed
    return handed


def agent_for(checkpoint: Checkpoint, agents: Mapping[str, Agent]) -> Agent | None:
    """The agent a step of ``checkpoint`` runs as, or None when this worker does not have it."""
    entry = agents.get(checkpoint.agent)
    if entry is None or checkpoint.active_agent is None:
        return entry
    target = _find(entry, checkpoint.active_agent, agents)
    return None if target is None else as_target(entry, target)


def target_of(agent: Agent, tool_name: str) -> Agent | None:
    """The agent a ``transfer_to_<name>`` call of ``agent`` hands the run to (None: not a handoff)."""
    if not tool_name.startswith(HANDOFF_PREFIX):
        return None
    return agent.handoffs.get(tool_name[len(HANDOFF_PREFIX) :])


def handoffs_in_input(checkpoint: Checkpoint) -> int:
    """How many handoffs the current input made so far (their results name the agent handed to)."""
    return sum(
        1
        for m in checkpoint.messages[checkpoint.run_start :]
        if m.role == "tool" and not m.is_error and (m.name or "").startswith(HANDOFF_PREFIX)
    )


def instructed(messages: list[Message], agent: Agent, checkpoint: Checkpoint) -> list[Message]:
    """``messages`` as the agent the run was handed to is asked them: its own instructions as the system message."""
    if checkpoint.active_agent is None:
        return messages
    body = messages[1:] if messages and messages[0].role == "system" else messages
    return [Message(role="system", content=agent.instructions), *body] if agent.instructions else list(body)
