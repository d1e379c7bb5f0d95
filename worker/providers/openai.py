"""``OpenAIModel``: Chat Completions with tool calling, for OpenAI and any OpenAI-compatible server.

Owns the conversion between our transcript and the Chat Completions wire format (both ways), the
reassembly of a streamed answer from its chunks, and the translation of the ``openai`` SDK's failures
into ``ProviderError``. It keeps no state a crash would lose: every call sends the whole transcript.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from store import errors
from store.records import Message, ToolCall, Usage
from worker.providers import _clients, _failures, _transcript
from worker.providers.base import Listener, ModelResponse, ToolSpec

PROVIDER = "openai"
API_KEY_ENV = "OPENAI_API_KEY"

#: Request fields the model fills itself; settings may not override them.
_RESERVED_SETTINGS = frozenset({"model", "messages", "tools", "stream", "stream_options"})


class OpenAIModel(_clients.SDKModel):
    """A model behind the Chat Completions API: OpenAI itself, or vLLM, Ollama, LM Studio, a gateway.

    The SDK's own retries are off: our step policy is the only retry loop. Each process builds its
    own client on first use. With a listener, the answer streams (``stream_options.include_usage``
    on, so usage is the same as a plain request's).

    Args:
        model: The model name the server knows (``gpt-4.1-mini``, ``llama3.2``…).
        base_url: An OpenAI-compatible server (``http://localhost:11434/v1``); OpenAI by default.
        api_key: The key; ``OPENAI_API_KEY`` when not given. With a ``base_url`` and no key, a
            placeholder is sent (local servers do not check it).
        timeout: Seconds one request may take; keep it below ``LOUSHO_STEP_SOFT_TIME_LIMIT_S``.
        client_options: More SDK client options (``organization``, ``default_headers``…).
        **settings: Request body fields sent with every request as they are (``temperature``,
            ``max_completion_tokens``, ``tool_choice``, ``parallel_tool_calls``…);
            ``extra_headers`` and ``extra_query`` keep their SDK meaning.

    Raises:
        ConfigurationError: the ``openai`` package is missing, no key is found for the hosted API,
            or an argument is unusable.
    """

    provider = PROVIDER
    sdk_module = "openai"
    client_class = "OpenAI"
    sdk_error = "OpenAIError"
    api_key_env = API_KEY_ENV
    reserved_settings = _RESERVED_SETTINGS
    request_id_header = "x-request-id"

    def __init__(
        self,
        model: str,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = _clients.DEFAULT_TIMEOUT_S,
        client_options: Mapping[str, Any] | None = None,
        **settings: Any,
    ) -> None:
        self._configure(model, base_url, api_key, timeout, client_options, settings)

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
        request: dict[str, Any] = {
            **self._request_options,
            "model": self.model,
            "messages": to_openai_messages(messages),
        }
        if tools:
            request["tools"] = openai_tools(tools)
        if listener is not None:
            answer = _CompletionStream(messages, listener)
            create = self._client.get().chat.completions.create
            self._stream(
                lambda: create(**request, stream=True, stream_options={"include_usage": True}), listener, answer.add
            )
            return parse_completion(answer.completion(), messages)
        try:
            completion = self._client.get().chat.completions.create(**request)
        except self._sdk.OpenAIError as exc:
            # ``from None``: the SDK error holds the request, whose headers carry the key.
            raise self._translate(exc) from None
        dump = getattr(completion, "model_dump", None)
        if dump is None:
            raise _failures.unexpected(
                PROVIDER, f"the answer is not a chat completion: {str(completion)[:200]}", self._secrets
            )
        return parse_completion(dump(mode="json", warnings=False), messages)


class _CompletionStream:
    """The chunks of a streamed chat completion put back together into the completion a plain request returns.

    As chunks are added it tells ``listener`` each piece of text and each tool call once, under the
    id the turn keeps (``parse_completion`` of ``completion()`` gives the call the same id). Only
    the first choice is read, as for a plain answer.
    """

    def __init__(self, transcript: Sequence[Message], listener: Listener) -> None:
        self._transcript = transcript
        self._listener = listener
        self._model: str | None = None
        self._content: str | None = None
        self._refusal: str | None = None
        self._calls: dict[int, dict[str, Any]] = {}
        self._finish_reason: str | None = None
        self._usage: dict[str, Any] | None = None

    def add(self, chunk: Mapping[str, Any]) -> None:
        """Take one ``chat.completion.chunk`` (as JSON)."""
        self._model = chunk.get("model") or self._model
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if (choice.get("index") or 0) != 0:
                continue
            delta = choice.get("delta") or {}
            text = delta.get("content")
            if text is not None:
                self._content = (self._content or "") + text
                if text:
                    self._listener.text(text)
            refusal = delta.get("refusal")
            if refusal:
                self._refusal = (self._refusal or "") + refusal
                self._listener.text(refusal)
            for fragment in delta.get("tool_calls") or ():
                self._add_call(fragment)
            self._finish_reason = choice.get("finish_reason") or self._finish_reason

    def _add_call(self, fragment: Mapping[str, Any]) -> None:
        # The first fragment of a call brings its id and name, later ones pieces of its argument JSON.
        index = int(fragment.get("index") or 0)
        call = self._calls.setdefault(
            index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
        )
        call["id"] = call["id"] or fragment.get("id")
        call["type"] = fragment.get("type") or call["type"]
        function = fragment.get("function") or {}
        call["function"]["arguments"] += function.get("arguments") or ""
        if call["function"]["name"] or not function.get("name"):
            return
        call["function"]["name"] = function["name"]
        if call["type"] != "function":
            return
        earlier = [self._calls[k] for k in sorted(self._calls) if k <= index]
        call["id"] = _transcript.assign_call_ids(
            [c["id"] for c in earlier if c["type"] == "function"], self._transcript
        )[-1]
        self._listener.tool_call(call["id"], call["function"]["name"])

    def completion(self) -> dict[str, Any]:
        """The chat completion (as JSON) the chunks make up.

        Raises:
            ProviderError: the stream ended before the answer's ``finish_reason`` (retryable).
        """
        if self._finish_reason is None:
            raise _failures.cut_off(PROVIDER, "the stream ended before the answer was complete")
        # A refused answer has no content, only the refusal (some servers stream an empty content first).
        content = None if self._refusal and not self._content else self._content
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": self._refusal}
        if self._calls:
            message["tool_calls"] = [self._calls[k] for k in sorted(self._calls)]
        return {
            "model": self._model,
            "usage": self._usage,
            "choices": [{"index": 0, "message": message, "finish_reason": self._finish_reason}],
        }


def openai_tools(tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    """Tool specs as Chat Completions ``function`` tools."""
    found = []
    for spec in tools:
        function: dict[str, Any] = {"name": spec.name, "parameters": spec.input_schema}
        if spec.description:
            function["description"] = spec.description
        found.append({"type": "function", "function": function})
    return found


def _wire_content(content: Any) -> Any:
    if content is None or isinstance(content, str):
        return content
    return _transcript.content_parts(content)


def to_openai_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Our transcript as Chat Completions ``messages``.

    Calls keep their ids, names and argument JSON (a malformed call's raw text is sent back as
    it was); results refer to their call by ``tool_call_id``. Chat Completions has no error flag
    on tool results: an error result's body says so.
    """
    wire: list[dict[str, Any]] = []
    for message in messages:
        if message.role == "tool":
            content = message.content
            if not isinstance(content, str):
                content = (
                    _transcript.content_parts(content) if isinstance(content, list) else _transcript.dumps(content)
                )
            wire.append(
                {
                    "role": "tool",
                    "tool_call_id": _transcript.wire_call_id(message.tool_call_id or ""),
                    "content": content,
                }
            )
            continue
        entry: dict[str, Any] = {"role": message.role, "content": _wire_content(message.content)}
        if entry["content"] is None and message.role != "assistant":
            entry["content"] = ""
        if message.name:
            entry["name"] = message.name
        if message.role == "assistant" and message.tool_calls:
            entry["tool_calls"] = [
                {
                    "id": _transcript.wire_call_id(call.id),
                    "type": "function",
                    "function": {
                        "name": call.name,
                        "arguments": _transcript.arguments_text(call.args, call.invalid_args),
                    },
                }
                for call in message.tool_calls
            ]
        wire.append(entry)
    return wire


def from_openai_messages(wire: Sequence[Mapping[str, Any]]) -> list[Message]:
    """Chat Completions ``messages`` as our transcript (the inverse of ``to_openai_messages``).

    Tool results get the name of the call they answer; arguments that are not a JSON object are
    kept in ``invalid_args``; ``developer`` messages become system messages.

    Raises:
        ConfigurationError: a message has a role we do not store (``function``, none).
    """
    names: dict[str, str] = {}
    messages: list[Message] = []
    for entry in wire:
        role = entry.get("role")
        if role == "tool":
            call_id = str(entry.get("tool_call_id") or "")
            messages.append(
                Message(role="tool", tool_call_id=call_id, content=entry.get("content"), name=names.get(call_id))
            )
            continue
        calls = []
        for raw in entry.get("tool_calls") or ():
            function = raw.get("function") or {}
            args, invalid = _transcript.parse_arguments(function.get("arguments"))
            call = ToolCall(
                id=str(raw.get("id") or ""), name=str(function.get("name") or ""), args=args, invalid_args=invalid
            )
            names[call.id] = call.name
            calls.append(call)
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant"):
            raise errors.ConfigurationError(f"unsupported chat message role {role!r}")
        messages.append(
            Message(role=role, content=entry.get("content"), tool_calls=calls or None, name=entry.get("name"))
        )
    return messages


def _usage(raw: Mapping[str, Any] | None) -> Usage:
    if not raw:
        return Usage()
    prompt = int(raw.get("prompt_tokens") or 0)
    completion = int(raw.get("completion_tokens") or 0)
    details = raw.get("prompt_tokens_details") or {}
    return Usage(
        input_tokens=prompt,
        output_tokens=completion,
        total_tokens=int(raw.get("total_tokens") or prompt + completion),
        cache_read_tokens=int(details.get("cached_tokens") or 0),
        cache_write_tokens=int(details.get("cache_write_tokens") or 0),
    )


def parse_completion(body: Mapping[str, Any], transcript: Sequence[Message]) -> ModelResponse:
    """A chat completion (as JSON) as one model turn: text, calls with parsed args, usage.

    Raises:
        ProviderError: the completion has no choice to read (retryable: a gateway hiccup).
    """
    choices = body.get("choices") or []
    if not choices:
        raise _failures.unexpected(PROVIDER, "the completion has no choices")
    choice = choices[0]
    message = choice.get("message") or {}
    raw_calls = [c for c in message.get("tool_calls") or () if (c.get("type") or "function") == "function"]
    ids = _transcript.assign_call_ids([c.get("id") for c in raw_calls], transcript)
    calls = []
    for call_id, raw in zip(ids, raw_calls, strict=True):
        function = raw.get("function") or {}
        args, invalid = _transcript.parse_arguments(function.get("arguments"))
        calls.append(ToolCall(id=call_id, name=str(function.get("name") or ""), args=args, invalid_args=invalid))
    content = message.get("content")
    text = _transcript.content_text(content) if content is not None else message.get("refusal")
    if calls and not text:
        text = None
    return ModelResponse(
        text=text,
        tool_calls=calls,
        usage=_usage(body.get("usage")),
        finish_reason=choice.get("finish_reason"),
        model_id=body.get("model"),
    )
