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
    """One model turn: final text, or tool calls (with optional text)."""

    text: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)


class Model(Protocol):
    """A chat model; ``generate`` must not keep state between calls that a crash would lose."""

    model_id: str

    def generate(self, messages: list[Message], tools: list[ToolSpec]) -> ModelResponse:
        """Answer the transcript. Raise ``store.errors.ProviderError`` on failure."""
        ...
