"""``MockModel``: a scripted model for tests and demos, deterministic across processes and crashes.

The response used is picked by the number of assistant turns already in the transcript, so a
worker that takes over a crashed one gets the same answer the crashed one would have.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from store import errors
from store.records import Message, ToolCall, Usage
from worker import machine
from worker.providers.base import Listener, ModelCallCancelled, ModelResponse, ToolSpec

Script = Sequence[Any] | Callable[[list[Message]], Any]


class MockModel:
    """Answers from ``script``: a list of responses, or a callable of the transcript.

    A response is a string (final text) or a dict with ``tool_calls`` (``[{"name", "args"}]``),
    and optionally ``text``, ``usage`` (``{"input_tokens", "output_tokens"}``), ``finish_reason`` (the
    provider's own, e.g. ``length``), ``delay_ms`` and
    ``error`` (a message; ``retryable`` says whether a retry may pass). Every transcript it
    receives is checked for validity; an invalid one fails the call.

    With a listener it streams: the wait of ``delay_ms`` comes first (cut short when the listener
    cancels), then the text word by word, ``stream_delay_ms`` apart.
    """

    #: Its usage is an estimate, not a bill: no extra write to keep it across crashes.
    reports_usage = False

    def __init__(self, script: Script, *, model_id: str = "mock") -> None:
        self.script = script
        self.model_id = model_id

    def spec(self) -> dict[str, Any]:
        """What the model is, as JSON: its ``model_id`` only (a script cannot be written down).

        So a saved choice of a ``MockModel`` finds it again only among the agent's ``models``.
        """
        return {"provider": "mock", "model_id": self.model_id}

    def generate(
        self, messages: list[Message], tools: list[ToolSpec], listener: Listener | None = None
    ) -> ModelResponse:
        """The scripted response for this transcript (chosen by its number of assistant turns)."""
        problems = machine.transcript_problems(messages)
        if problems:
            raise errors.ProviderError(f"invalid transcript: {problems[0]}", retryable=False)
        turn = sum(1 for m in messages if m.role == "assistant")
        if callable(self.script):
            response = self.script(messages)
        elif turn < len(self.script):
            response = self.script[turn]
        else:
            raise errors.ProviderError(f"MockModel script has no response for turn {turn + 1}", retryable=False)
        return self._response(response, turn, messages, listener)

    def _response(self, response: Any, turn: int, messages: list[Message], listener: Listener | None) -> ModelResponse:
        if isinstance(response, str):
            response = {"text": response}
        if not isinstance(response, dict):
            raise errors.ConfigurationError(f"MockModel response must be a str or dict, got {type(response).__name__}")
        if response.get("delay_ms"):
            if listener is None:
                time.sleep(float(response["delay_ms"]) / 1000)
            elif listener.cancelled.wait(float(response["delay_ms"]) / 1000):
                raise ModelCallCancelled()
        if response.get("error"):
            raise errors.ProviderError(str(response["error"]), retryable=bool(response.get("retryable", True)))
        calls = [
            ToolCall(id=call.get("id") or f"call_{turn}_{k}", name=call["name"], args=call.get("args") or {})
            for k, call in enumerate(response.get("tool_calls") or [])
        ]
        text = response.get("text")
        if listener is not None:
            _stream(listener, text or "", calls, float(response.get("stream_delay_ms") or 0) / 1000)
        scripted = response.get("usage")
        if scripted:
            usage = Usage(
                input_tokens=int(scripted.get("input_tokens", 0)), output_tokens=int(scripted.get("output_tokens", 0))
            )
        else:
            prompt = sum(len(str(m.content or "")) for m in messages) // 4 + 1
            usage = Usage(input_tokens=prompt, output_tokens=len(text or "") // 4 + len(calls) + 1)
        usage = usage.model_copy(update={"total_tokens": usage.input_tokens + usage.output_tokens})
        return ModelResponse(text=text, tool_calls=calls, usage=usage, finish_reason=response.get("finish_reason"))


def _stream(listener: Listener, text: str, calls: list[ToolCall], pause_s: float) -> None:
    """Tell ``listener`` the answer piece by piece, as a streaming provider would."""
    for index, word in enumerate(text.split(" ")):
        if listener.cancelled.is_set() or (pause_s and listener.cancelled.wait(pause_s)):
            raise ModelCallCancelled()
        listener.text(word if index == 0 else " " + word)
    for call in calls:
        listener.tool_call(call.id, call.name)
