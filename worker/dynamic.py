"""Dynamic agents: the model, tools and instructions chosen per run by ``Agent(..., resolve=fn)``.

``fn(ctx)`` runs on the worker when an input starts (a new run, or a follow-up to a finished one) and returns
a ``RunConfig``. The choice is saved with the run (``Checkpoint.run_config``: the model's spec, without
secrets, and where the input that chose it sits in the transcript). Every later step of that input, on any
worker and after any crash, uses the saved model, and resolves tools and instructions again from the same
context, so it never switches model half way; the next follow-up chooses again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from store import errors, payloads
from store.records import Checkpoint, InboxEntry, Message
from worker.agents import Agent, Tool
from worker.providers.base import Model

__all__ = ["ResolveContext", "RunConfig", "for_run"]


@dataclass(frozen=True)
class RunConfig:
    """What ``resolve`` chose for one input; a field left None is the agent's own."""

    model: Model | None = None
    tools: Iterable[Tool] | None = None
    instructions: str | None = None


@dataclass(frozen=True)
class ResolveContext:
    """What ``resolve`` decides from: the run, the input that starts it, and the metadata sent with it."""

    session_id: str
    agent: str
    input: Sequence[Message]
    metadata: dict[str, Any] | None = None


def _resolve(agent: Agent, ctx: ResolveContext) -> RunConfig:
    """``agent.resolve(ctx)``, checked.

    Raises:
        ConfigResolverError: it raised or returned something else than a ``RunConfig``.
    """
    assert agent.resolve is not None
    try:
        config = agent.resolve(ctx)
    except Exception as exc:  # recorded as the run's last error; the input stays queued
        raise errors.ConfigResolverError(
            payloads.clean_error(f"resolve of agent {agent.name!r} raised {type(exc).__name__}: {exc}")
        ) from exc
    if not isinstance(config, RunConfig):
        raise errors.ConfigResolverError(
            f"resolve of agent {agent.name!r} returned {type(config).__name__}, not a RunConfig"
        )
    if config.model is None and agent.model is None:
        raise errors.ConfigResolverError(f"resolve of agent {agent.name!r} chose no model and the agent has none")
    return config


def _configured(agent: Agent, config: RunConfig, model: Model) -> Agent:
    """A static agent with ``agent``'s settings and what ``config`` chose (``model`` as given)."""
    changes: dict[str, Any] = {"model": model, "resolve": None, "models": ()}
    if config.tools is not None:
        changes["tools"] = tuple(config.tools)
    if config.instructions is not None:
        changes["instructions"] = config.instructions
    return agent.replace(**changes)


def _starts_input(checkpoint: Checkpoint, inbox: Sequence[InboxEntry]) -> bool:
    """Whether the queued input starts a new input of the run (a new run, or a follow-up to a finished one)."""
    fresh = [entry for entry in inbox if entry.n > checkpoint.inbox_cursor]
    return bool(fresh) and (not checkpoint.messages or checkpoint.status == "finished")


def for_run(agent: Agent, checkpoint: Checkpoint, inbox: Sequence[InboxEntry]) -> tuple[Agent, bool]:
    """The agent that runs this step of ``checkpoint``, and whether it chose anew (the choice must be saved).

    A static agent is itself. A dynamic one resolves from the queued input when it starts a new input, else
    from the saved context with the saved model.

    Raises:
        ConfigResolverError: ``resolve`` failed, or the saved model cannot be rebuilt.
    """
    if agent.resolve is None:
        return agent, False
    if _starts_input(checkpoint, inbox):
        fresh = [entry for entry in inbox if entry.n > checkpoint.inbox_cursor]
        metadata = next((e.metadata for e in reversed(fresh) if e.metadata is not None), None)
        ctx = ResolveContext(
            checkpoint.session_id,
            agent.name,
            [m for entry in fresh for m in entry.messages if m.role != "system"],
            metadata,
        )
        config = _resolve(agent, ctx)
        model = config.model if config.model is not None else agent.model
        assert model is not None
        return _configured(agent, config, model), True
    saved = checkpoint.run_config or {}
    start, end = saved.get("input", [checkpoint.run_start, len(checkpoint.messages)])
    ctx = ResolveContext(checkpoint.session_id, agent.name, list(checkpoint.messages[start:end]), checkpoint.metadata)
    config = _resolve(agent, ctx)
    spec = saved.get("model")
    if spec is None:  # a run stored without a choice (a fork of a static run, say): choose now
        model = config.model if config.model is not None else agent.model
        assert model is not None
        return _configured(agent, config, model), False
    candidates = [m for m in (config.model, agent.model, *agent.models) if m is not None]
    try:
        model = _saved_model(spec, candidates)
    except errors.ConfigurationError as exc:
        raise errors.ConfigResolverError(
            f"the model run {checkpoint.session_id!r} chose cannot be rebuilt: {exc.message}"
        ) from exc
    return _configured(agent, config, model), False


#: Models rebuilt from a saved spec, by spec (a rebuilt model holds its own client: not one per step).
_rebuilt: dict[str, Model] = {}
_REBUILT_MAX = 64


def _saved_model(spec: dict[str, Any], candidates: list[Model]) -> Model:
    """The model ``spec`` names: one of ``candidates``, or one rebuilt from it (kept for the next step)."""
    from worker.providers.specs import model_from_spec  # the SDK clients load only for dynamic agents

    key = payloads.dumps(spec)
    cached = _rebuilt.get(key)
    if cached is not None:
        return cached
    model = model_from_spec(spec, candidates)
    if not any(model is candidate for candidate in candidates):
        if len(_rebuilt) >= _REBUILT_MAX:
            _rebuilt.pop(next(iter(_rebuilt)))
        _rebuilt[key] = model
    return model


def chosen(checkpoint: Checkpoint, agent: Agent) -> Checkpoint:
    """``checkpoint`` (input just merged) with ``agent``'s choice saved: the model's spec and the input's place."""
    from worker.providers.specs import model_spec

    assert agent.model is not None
    return checkpoint.model_copy(
        update={
            "run_config": {"model": model_spec(agent.model), "input": [checkpoint.run_start, len(checkpoint.messages)]}
        }
    )
