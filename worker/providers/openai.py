"""``OpenAIModel``: Chat Completions with tool calling, for OpenAI and any OpenAI-compatible server.

Owns the conversion between our transcript and the Chat Completions wire format (both ways) and
the translation of the ``openai`` SDK's failures into ``ProviderError``. It keeps no state a crash
would lose: every call sends the whole transcript.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from store import errors
from store.records import Message, ToolCall, Usage
from worker.providers import _clients, _failures, _transcript
from worker.providers.base import ModelResponse, ToolSpec

PROVIDER = "openai"
API_KEY_ENV = "OPENAI_API_KEY"

#: Request fields the model fills itself; settings may not override them.
_RESERVED_SETTINGS = frozenset({"model", "messages", "tools", "stream", "stream_options"})


class OpenAIModel(_clients.SDKModel):
    """A model behind the Chat Completions API: OpenAI itself, or vLLM, Ollama, LM Studio, a gateway.

    The SDK's own retries are off: our step policy is the only retry loop. Each process builds its
    own client on first use.

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
    api_key_env = API_KEY_ENV
    reserved_settings = _RESERVED_SETTINGS

    def __init__(self, model: str, base_url: str | None = None, api_key: str | None = None, *,
                 timeout: float = _clients.DEFAULT_TIMEOUT_S, client_options: Mapping[str, Any] | None = None,
                 **settings: Any) -> None:
        self._configure(model, base_url, api_key, timeout, client_options, settings)

    def generate(self, messages: list[Message], tools: list[ToolSpec]) -> ModelResponse:
        """Ask for the next assistant turn of ``messages``.

        Raises:
            ProviderError: the request failed; ``retryable`` and ``category`` say how
                (``ProviderRateLimitedError`` for a 429, with the server's ``retry_after``).
        """
        request: dict[str, Any] = {**self._request_options, "model": self.model,
                                   "messages": to_openai_messages(messages)}
        if tools:
            request["tools"] = openai_tools(tools)
        try:
            completion = self._client.get().chat.completions.create(**request)
        except self._sdk.OpenAIError as exc:
            # ``from None``: the SDK error holds the request, whose headers carry the key.
            raise _clients.translate(PROVIDER, self._sdk, exc, timeout=self.timeout, request_id_header="x-request-id",
                                      secrets=self._secrets) from None
        dump = getattr(completion, "model_dump", None)
        if dump is None:
            raise _failures.unexpected(PROVIDER, f"the answer is not a chat completion: {str(completion)[:200]}",
                                       self._secrets)
        return parse_completion(dump(mode="json", warnings=False), messages)


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
                content = _transcript.content_parts(content) if isinstance(content, list) else \
                    _transcript.dumps(content)
            wire.append({"role": "tool", "tool_call_id": _transcript.wire_call_id(message.tool_call_id or ""),
                         "content": content})
            continue
        entry: dict[str, Any] = {"role": message.role, "content": _wire_content(message.content)}
        if entry["content"] is None and message.role != "assistant":
            entry["content"] = ""
        if message.name:
            entry["name"] = message.name
        if message.role == "assistant" and message.tool_calls:
            entry["tool_calls"] = [
                {"id": _transcript.wire_call_id(call.id), "type": "function",
                 "function": {"name": call.name, "arguments": _transcript.arguments_text(call.args,
                                                                                         call.invalid_args)}}
                for call in message.tool_calls]
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
            messages.append(Message(role="tool", tool_call_id=call_id, content=entry.get("content"),
                                    name=names.get(call_id)))
            continue
        calls = []
        for raw in entry.get("tool_calls") or ():
            function = raw.get("function") or {}
            args, invalid = _transcript.parse_arguments(function.get("arguments"))
            call = ToolCall(id=str(raw.get("id") or ""), name=str(function.get("name") or ""), args=args,
                            invalid_args=invalid)
            names[call.id] = call.name
            calls.append(call)
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant"):
            raise errors.ConfigurationError(f"unsupported chat message role {role!r}")
        messages.append(Message(role=role, content=entry.get("content"), tool_calls=calls or None,
                                name=entry.get("name")))
    return messages


def _usage(raw: Mapping[str, Any] | None) -> Usage:
    if not raw:
        return Usage()
    prompt = int(raw.get("prompt_tokens") or 0)
    completion = int(raw.get("completion_tokens") or 0)
    details = raw.get("prompt_tokens_details") or {}
    return Usage(input_tokens=prompt, output_tokens=completion,
                 total_tokens=int(raw.get("total_tokens") or prompt + completion),
                 cache_read_tokens=int(details.get("cached_tokens") or 0),
                 cache_write_tokens=int(details.get("cache_write_tokens") or 0))


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
    return ModelResponse(text=text, tool_calls=calls, usage=_usage(body.get("usage")),
                         finish_reason=choice.get("finish_reason"), model_id=body.get("model"))
