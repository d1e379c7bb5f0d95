"""The model port: what the step machine asks of any provider, and what it gets back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from store.records import Message, ToolCall, Usage


@dataclass(frozen=True)
class ToolSpec:
    """A tool as the model sees it."""

    name: str
    description: str
    input_schema: dict[str, Any]


@dataclass(frozen=True)
class ModelResponse:
    """One model turn: final text, or tool calls (with optional text).

    ``finish_reason`` is the provider's own (``stop``, ``tool_calls``, ``length``…) and
    ``model_id`` the model that answered, when the provider says.
    """

    text: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)
    finish_reason: str | None = None
    model_id: str | None = None


class ModelCallCancelled(Exception):
    """A model call given up because ``Listener.cancelled`` was set (an abort or a steer); nothing is saved."""


class Cancellation(Protocol):
    """Whether a model call should stop now; ``threading.Event`` is one."""

    def is_set(self) -> bool:
        """True once the call should stop."""

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the call should stop or ``timeout`` passed; whether it should stop."""


class Listener(Protocol):
    """Someone watching a model call as it streams, and able to cut it short.

    A model whose ``generate`` takes a ``listener`` keyword streams when one is given: it calls ``text``
    with each piece of text as it arrives and ``tool_call`` when a tool call first appears, and checks
    ``cancelled`` between pieces, raising ``ModelCallCancelled`` once it is set. Without a listener it makes
    one plain request. Usage, errors and retries are the same either way; what a listener hears is never
    saved (the returned ``ModelResponse`` is).
    """

    @property
    def cancelled(self) -> Cancellation:
        """Set when the call should stop now (the run was aborted, or steered before anything was emitted)."""

    def text(self, delta: str) -> None:
        """A piece of the answer's text, as it streams."""

    def tool_call(self, call_id: str, name: str) -> None:
        """A tool call of the answer started to stream."""


class Model(Protocol):
    """A chat model; ``generate`` must not keep state between calls that a crash would lose.

    To add a provider: convert ``messages`` (system/user/assistant/tool ``Message`` records; an
    assistant turn's ``tool_calls`` carry ``id``, ``name`` and parsed ``args``; a tool result
    carries ``tool_call_id`` and text ``content``) to the provider's request, and its answer back
    to a ``ModelResponse``. Raise ``store.errors.ProviderError`` with ``retryable`` set by the
    failure's class (rate limit, timeout, connection, 5xx: True; 400/401/403/404, context length:
    False) and ``retry_after`` when the provider gives one. Turn malformed argument JSON into a
    ``ToolCall`` with ``invalid_args`` set rather than raising. ``model_id`` is part of the agent
    fingerprint. To stream, accept an optional ``listener: Listener | None = None`` keyword (see
    ``Listener``); a model without it is called without one and cut short only between calls.
    """

    model_id: str

    def generate(self, messages: list[Message], tools: list[ToolSpec]) -> ModelResponse:
        """Answer the transcript. Raise ``store.errors.ProviderError`` on failure."""
        ...
