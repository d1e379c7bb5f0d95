"""``AnthropicModel``: the Anthropic Messages API with tool use.

Owns the conversion between our transcript and Messages content blocks (both ways: system prompt
apart, tool results as ``tool_result`` blocks in a user turn), the reassembly of a streamed answer
from its events, and the translation of the ``anthropic`` SDK's failures into ``ProviderError``. It
keeps no state a crash would lose.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from store import errors
from store.records import Message, ToolCall, Usage
from worker.providers import _clients, _failures, _transcript
from worker.providers.base import Listener, ModelResponse, ToolSpec

PROVIDER = "anthropic"
API_KEY_ENV = "ANTHROPIC_API_KEY"
#: ``max_tokens`` is required by the Messages API; this is ours unless given.
DEFAULT_MAX_TOKENS = 4096

_RESERVED_SETTINGS = frozenset({"model", "messages", "system", "tools", "stream"})
_EPHEMERAL = {"type": "ephemeral"}

System = str | list[dict[str, Any]] | None


class AnthropicModel(_clients.SDKModel):
    """A Claude model behind the Messages API.

    The SDK's own retries are off: our step policy is the only retry loop. Each process builds its
    own client on first use. With a listener, the answer streams.

    Args:
        model: The model name (``claude-sonnet-4-5``…).
        api_key: The key; ``ANTHROPIC_API_KEY`` when not given. With a ``base_url`` and no key, a
            placeholder is sent.
        base_url: Another endpoint speaking the Messages API (a proxy or gateway).
        timeout: Seconds one request may take; keep it below ``LOUSHO_STEP_SOFT_TIME_LIMIT_S``.
        max_tokens: The most tokens one answer may have (the API requires a value).
        cache_prompt: Mark the tools, the system prompt and the transcript so far for prompt
            caching on every turn; the cache tokens show in ``Usage``.
        client_options: More SDK client options (``default_headers``…).
        **settings: Request body fields sent with every request as they are (``temperature``,
            ``tool_choice``, ``metadata``…); ``extra_headers`` and ``extra_query`` keep their SDK
            meaning. Extended ``thinking`` does not mix with tools here: thinking blocks are not
            kept in the transcript, and the API wants them back on the turn after a tool call.

    Raises:
        ConfigurationError: the ``anthropic`` package is missing, no key is found for the hosted API,
            or an argument is unusable.
    """

    provider = PROVIDER
    sdk_module = "anthropic"
    client_class = "Anthropic"
    sdk_error = "AnthropicError"
    api_key_env = API_KEY_ENV
    reserved_settings = _RESERVED_SETTINGS
    request_id_header = "request-id"

    def __init__(
        self,
        model: str,
        api_key: str | None = None,
        base_url: str | None = None,
        *,
        timeout: float = _clients.DEFAULT_TIMEOUT_S,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        cache_prompt: bool = False,
        client_options: Mapping[str, Any] | None = None,
        **settings: Any,
    ) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise errors.ConfigurationError("max_tokens must be a positive integer")
        self.max_tokens = max_tokens
        self.cache_prompt = cache_prompt
        self._configure(model, base_url, api_key, timeout, client_options, settings)

    def spec(self) -> dict[str, Any]:
        """What the model is, as JSON without secrets (``SDKModel.spec``), with ``max_tokens`` and ``cache_prompt``."""
        return {**super().spec(), "max_tokens": self.max_tokens, "cache_prompt": bool(self.cache_prompt)}

    def generate(
        self, messages: list[Message], tools: list[ToolSpec], listener: Listener | None = None
    ) -> ModelResponse:
        """Ask for the next assistant turn of ``messages``; streamed to ``listener`` when one is given.

        Raises:
            ProviderError: the request failed; ``retryable`` and ``category`` say how
                (``ProviderRateLimitedError`` for a 429, with the server's ``retry_after``). A stream
                that breaks off is a retryable ``connection`` failure.
            ModelCallCancelled: ``listener.cancelled`` was set before the answer was complete.
        """
        system, wire = to_anthropic_messages(messages)
        specs = anthropic_tools(tools)
        if self.cache_prompt:
            system, wire, specs = mark_cache_points(system, wire, specs)
        request: dict[str, Any] = {
            **self._request_options,
            "max_tokens": self.max_tokens,
            "model": self.model,
            "messages": wire,
        }
        if system:
            request["system"] = system
        if specs:
            request["tools"] = specs
        if listener is not None:
            answer = _MessageStream(messages, listener)
            create = self._client.get().messages.create
            self._stream(lambda: create(**request, stream=True), listener, answer.add)
            return parse_message(answer.message(), messages)
        try:
            reply = self._client.get().messages.create(**request)
        except self._sdk.AnthropicError as exc:
            # ``from None``: the SDK error holds the request, whose headers carry the key.
            raise self._translate(exc) from None
        dump = getattr(reply, "model_dump", None)
        if dump is None:
            raise _failures.unexpected(PROVIDER, f"the answer is not a message: {str(reply)[:200]}", self._secrets)
        return parse_message(dump(mode="json", warnings=False), messages)


class _MessageStream:
    """The events of a streamed Messages answer put back together into the message a plain request returns.

    As events are added it tells ``listener`` each piece of text and each ``tool_use`` once, under
    the id the turn keeps (``parse_message`` of ``message()`` gives the call the same id).
    """

    def __init__(self, transcript: Sequence[Message], listener: Listener) -> None:
        self._transcript = transcript
        self._listener = listener
        self._message: dict[str, Any] | None = None
        self._usage: dict[str, Any] = {}
        self._blocks: dict[int, dict[str, Any]] = {}
        self._input_json: dict[int, str] = {}
        self._stopped = False

    def add(self, event: Mapping[str, Any]) -> None:
        """Take one stream event (as JSON); ``ping`` and events of unknown types change nothing."""
        kind = event.get("type")
        if kind == "message_start":
            self._message = dict(event.get("message") or {})
            self._usage = dict(self._message.get("usage") or {})
        elif kind == "content_block_start":
            block = dict(event.get("content_block") or {})
            self._blocks[int(event.get("index") or 0)] = block
            if block.get("type") == "tool_use":
                uses = [b for _, b in sorted(self._blocks.items()) if b.get("type") == "tool_use"]
                block["id"] = _transcript.assign_call_ids([b.get("id") for b in uses], self._transcript)[-1]
                self._listener.tool_call(block["id"], str(block.get("name") or ""))
        elif kind == "content_block_delta":
            self._add_delta(int(event.get("index") or 0), event.get("delta") or {})
        elif kind == "message_delta":
            if self._message is not None:
                self._message.update((k, v) for k, v in (event.get("delta") or {}).items() if k.startswith("stop_"))
            # Usage on a message_delta is cumulative; counts it leaves out keep their message_start value.
            self._usage.update((k, v) for k, v in (event.get("usage") or {}).items() if v is not None)
        elif kind == "message_stop":
            self._stopped = True

    def _add_delta(self, index: int, delta: Mapping[str, Any]) -> None:
        block = self._blocks.get(index)
        if block is None:
            return
        if delta.get("type") == "text_delta" and block.get("type") == "text":
            text = str(delta.get("text") or "")
            block["text"] = str(block.get("text") or "") + text
            if text:
                self._listener.text(text)
        elif delta.get("type") == "input_json_delta":
            self._input_json[index] = self._input_json.get(index, "") + str(delta.get("partial_json") or "")

    def message(self) -> dict[str, Any]:
        """The Messages answer (as JSON) the events make up.

        Raises:
            ProviderError: the stream ended before ``message_stop`` (retryable).
        """
        if self._message is None or not self._stopped:
            raise _failures.cut_off(PROVIDER, "the stream ended before the answer was complete")
        content = []
        for index, block in sorted(self._blocks.items()):
            if index in self._input_json:
                block = {**block, "input": self._input_json[index]}
            content.append(block)
        return {**self._message, "content": content, "usage": self._usage}


def anthropic_tools(tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    """Tool specs as Messages API tools."""
    found = []
    for spec in tools:
        entry: dict[str, Any] = {"name": spec.name, "input_schema": spec.input_schema}
        if spec.description:
            entry["description"] = spec.description
        found.append(entry)
    return found


def _blocks(content: Any) -> list[dict[str, Any]]:
    # The API refuses empty text blocks; other parts (images, documents) pass as given.
    return [p for p in _transcript.content_parts(content) if p.get("type") != "text" or p.get("text")]


def _result_content(content: Any) -> Any:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    return _blocks(content) if isinstance(content, list) else _transcript.dumps(content)


def to_anthropic_messages(messages: Sequence[Message]) -> tuple[System, list[dict[str, Any]]]:
    """Our transcript as (``system``, ``messages``) of a Messages request.

    System messages go to ``system`` (a string for one text prompt, else text blocks). Tool results
    become ``tool_result`` blocks, consecutive ones in one user turn, with ``is_error`` kept. Empty
    text is left out, since the API refuses it. A malformed call's arguments go back as ``{}`` (the
    API wants an object); its error result tells the model what was wrong.
    """
    system: list[dict[str, Any]] = []
    plain_system: list[str] = []
    wire: list[dict[str, Any]] = []
    results_open = False
    for message in messages:
        if message.role == "system":
            system.extend(_blocks(message.content))
            if isinstance(message.content, str):
                plain_system.append(message.content)
            continue
        if message.role == "tool":
            block: dict[str, Any] = {
                "type": "tool_result",
                "tool_use_id": _transcript.wire_call_id(message.tool_call_id or ""),
                "content": _result_content(message.content),
            }
            if message.is_error:
                block["is_error"] = True
            if results_open:
                wire[-1]["content"].append(block)
            else:
                wire.append({"role": "user", "content": [block]})
                results_open = True
            continue
        results_open = False
        calls = (message.tool_calls or []) if message.role == "assistant" else []
        if isinstance(message.content, str) and not calls:
            if message.content:
                wire.append({"role": message.role, "content": message.content})
            continue
        blocks = _blocks(message.content)
        blocks.extend(
            {
                "type": "tool_use",
                "id": _transcript.wire_call_id(c.id),
                "name": c.name,
                "input": {} if c.invalid_args is not None else dict(c.args),
            }
            for c in calls
        )
        if blocks:
            wire.append({"role": message.role, "content": blocks})
    if len(plain_system) == 1 and len(system) == 1:
        return plain_system[0] or None, wire
    return system or None, wire


def _from_blocks(blocks: Sequence[Mapping[str, Any]]) -> Any:
    # One plain text block reads back as a string (what we send for string content), more as parts.
    parts = [dict(b) for b in blocks]
    if len(parts) == 1 and parts[0].get("type") == "text" and set(parts[0]) == {"type", "text"}:
        return parts[0]["text"]
    return parts or None


def from_anthropic_messages(system: System, wire: Sequence[Mapping[str, Any]]) -> list[Message]:
    """(``system``, ``messages``) of a Messages request as our transcript (the inverse of ``to_anthropic_messages``).

    Each system block becomes a system message; each ``tool_result`` block a tool message named
    after its call; an input that is not an object is kept in ``invalid_args``.

    Raises:
        ConfigurationError: a message has a role other than ``user`` or ``assistant``.
    """
    messages: list[Message] = []
    if isinstance(system, str):
        messages.append(Message(role="system", content=system))
    else:
        messages.extend(Message(role="system", content=_from_blocks([b])) for b in system or ())
    names: dict[str, str] = {}
    for entry in wire:
        role = entry.get("role")
        if role not in ("user", "assistant"):
            raise errors.ConfigurationError(f"unsupported Messages API role {role!r}")
        content = entry.get("content")
        if isinstance(content, str):
            messages.append(Message(role=role, content=content))
            continue
        blocks = list(content or ())
        if role == "assistant":
            calls = [_call(b["id"], b) for b in blocks if b.get("type") == "tool_use"]
            names.update((c.id, c.name) for c in calls)
            text = _from_blocks([b for b in blocks if b.get("type") != "tool_use"])
            messages.append(Message(role="assistant", content=text, tool_calls=calls or None))
            continue
        pending: list[Mapping[str, Any]] = []
        for block in blocks:
            if block.get("type") != "tool_result":
                pending.append(block)
                continue
            if pending:
                messages.append(Message(role="user", content=[dict(b) for b in pending]))
                pending = []
            result = block.get("content")
            call_id = str(block.get("tool_use_id") or "")
            messages.append(
                Message(
                    role="tool",
                    tool_call_id=call_id,
                    name=names.get(call_id),
                    content=result if isinstance(result, str) else _from_blocks(result or []),
                    is_error=True if block.get("is_error") else None,
                )
            )
        if pending:
            messages.append(Message(role="user", content=[dict(b) for b in pending]))
    return messages


def _call(call_id: str, block: Mapping[str, Any]) -> ToolCall:
    args, invalid = _transcript.parse_arguments(block.get("input"))
    return ToolCall(id=call_id, name=str(block.get("name") or ""), args=args, invalid_args=invalid)


def mark_cache_points(
    system: System, wire: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> tuple[System, list[dict[str, Any]], list[dict[str, Any]]]:
    """Copies of the request parts with cache breakpoints on the last tool, system block and message block.

    Three of the four breakpoints the API allows: each turn reads the prefix the previous turn wrote.
    """
    if tools:
        tools = [*tools[:-1], {**tools[-1], "cache_control": _EPHEMERAL}]
    if system:
        blocks = [_transcript.text_part(system)] if isinstance(system, str) else list(system)
        system = [*blocks[:-1], {**blocks[-1], "cache_control": _EPHEMERAL}]
    if wire:
        last = wire[-1]
        content = last["content"]
        blocks = [_transcript.text_part(content)] if isinstance(content, str) else list(content)
        wire = [*wire[:-1], {**last, "content": [*blocks[:-1], {**blocks[-1], "cache_control": _EPHEMERAL}]}]
    return system, wire, tools


def _usage(raw: Mapping[str, Any] | None) -> Usage:
    # ``input_tokens`` leaves out the cached part; ours counts every prompt token, as OpenAI does.
    if not raw:
        return Usage()
    read = int(raw.get("cache_read_input_tokens") or 0)
    written = int(raw.get("cache_creation_input_tokens") or 0)
    prompt = int(raw.get("input_tokens") or 0) + read + written
    output = int(raw.get("output_tokens") or 0)
    return Usage(
        input_tokens=prompt,
        output_tokens=output,
        total_tokens=prompt + output,
        cache_read_tokens=read,
        cache_write_tokens=written,
    )


def parse_message(body: Mapping[str, Any], transcript: Sequence[Message]) -> ModelResponse:
    """A Messages API answer (as JSON) as one model turn: text, calls with parsed input, usage.

    Text blocks are joined; ``thinking`` and server-tool blocks are not kept.
    """
    blocks = [b for b in body.get("content") or () if isinstance(b, Mapping)]
    uses = [b for b in blocks if b.get("type") == "tool_use"]
    ids = _transcript.assign_call_ids([b.get("id") for b in uses], transcript)
    calls = [_call(call_id, block) for call_id, block in zip(ids, uses, strict=True)]
    texts = [str(b.get("text") or "") for b in blocks if b.get("type") == "text"]
    text: str | None = "".join(texts) if texts else None
    if calls and not text:
        text = None
    return ModelResponse(
        text=text,
        tool_calls=calls,
        usage=_usage(body.get("usage")),
        finish_reason=body.get("stop_reason"),
        model_id=body.get("model"),
    )
