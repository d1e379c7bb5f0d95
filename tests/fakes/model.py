"""A model wrapper that logs every transcript it is given, and whether it was valid (I4)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from store.records import Message
from worker import machine
from worker.providers.base import Model, ModelResponse, ToolSpec


@dataclass(frozen=True)
class ModelCall:
    """One ``generate`` call: the transcript, what was wrong with it, and what the observer added."""

    messages: list[Message]
    problems: list[str]
    context: dict[str, Any] = field(default_factory=dict)

    @property
    def assistant_turns(self) -> int:
        """How many assistant turns the transcript already had (the index of the turn asked for)."""
        return sum(1 for m in self.messages if m.role == "assistant")


class RecordingModel:
    """Delegates to ``inner`` after logging the call; ``observe`` adds caller context to the log."""

    def __init__(self, inner: Model, observe: Callable[[], dict[str, Any]] | None = None) -> None:
        self.inner = inner
        self.model_id = inner.model_id
        self.observe = observe
        self.calls: list[ModelCall] = []

    def generate(self, messages: list[Message], tools: list[ToolSpec]) -> ModelResponse:
        context = self.observe() if self.observe is not None else {}
        self.calls.append(ModelCall(list(messages), machine.transcript_problems(messages), context))
        return self.inner.generate(messages, tools)
