"""A local HTTP server that speaks enough Chat Completions and Messages API for the real SDK clients.

Tests script its answers (turns, HTTP failures, slow answers, hang-ups) and read back every request
it got. A request with ``"stream": true`` gets its turn as Server-Sent Events in the API's own shape
(chunked, piece by piece), which tests can also cut off, hold, pace or end with an error event. It
listens on 127.0.0.1 on a free port; nothing here reaches the network.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal

Api = Literal["openai", "anthropic"]


@dataclass(frozen=True)
class Call:
    """A tool call in a scripted turn; ``args`` as text is sent verbatim (malformed JSON included)."""

    name: str
    args: dict[str, Any] | str = field(default_factory=dict)
    id: str | None = None


@dataclass(frozen=True)
class Turn:
    """A successful answer: text and/or tool calls, with the usage the server reports."""

    text: str | None = None
    calls: tuple[Call, ...] = ()
    input_tokens: int = 10
    output_tokens: int = 5
    cache_read: int = 0
    cache_write: int = 0
    finish: str | None = None
    model: str = "fake-model-2025"


@dataclass(frozen=True)
class Failure:
    """An HTTP error in the API's own error envelope."""

    status: int
    message: str = "failure"
    code: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Slow:
    """``reply`` after ``seconds`` (past the client timeout, the client has given up by then)."""

    seconds: float
    reply: Reply


@dataclass(frozen=True)
class Hangup:
    """Close the connection without any HTTP answer."""


@dataclass(frozen=True)
class Cut:
    """Stream the first ``after`` events of ``reply``, then stop: drop the connection mid-body, or
    (``clean``) end the HTTP body properly with the answer unfinished. A plain request gets a hang-up."""

    after: int
    reply: Turn
    clean: bool = False


@dataclass(frozen=True)
class Hold:
    """Stream the first ``after`` events of ``reply``, then wait until the client closes the connection
    (recorded in ``FakeProviderServer.held``) or ``seconds`` pass, then send the rest."""

    after: int
    reply: Turn
    seconds: float = 5.0


@dataclass(frozen=True)
class Paced:
    """Stream ``reply`` with ``interval`` seconds before each event."""

    interval: float
    reply: Turn


@dataclass(frozen=True)
class StreamFailure:
    """Stream the first ``after`` events of ``reply``, then an error event carrying ``failure``."""

    after: int
    reply: Turn
    failure: Failure


Reply = Turn | Failure | Slow | Hangup | Cut | Hold | Paced | StreamFailure
Script = Callable[[Api, dict[str, Any]], Reply]


@dataclass(frozen=True)
class Request:
    """One request the server got."""

    api: Api
    path: str
    headers: dict[str, str]
    body: dict[str, Any]

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The request's ``messages``."""
        return list(self.body.get("messages") or [])

    @property
    def assistant_turns(self) -> int:
        """How many assistant turns the transcript sent already has."""
        return sum(1 for m in self.messages if m.get("role") == "assistant")

    @property
    def first_user_text(self) -> str:
        """The text of the first user message (tests key runs on it)."""
        for message in self.messages:
            if message.get("role") != "user":
                continue
            content = message.get("content")
            if isinstance(content, str):
                return content
            return "".join(b.get("text", "") for b in content or () if b.get("type") == "text")
        return ""


_OPENAI_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
    429: "requests",
    500: "server_error",
}
_ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


def _openai_completion(turn: Turn, number: int) -> dict[str, Any]:
    calls = [
        {
            "id": f"call_fake_{number}_{k}" if call.id is None else call.id,
            "type": "function",
            "function": {
                "name": call.name,
                "arguments": call.args if isinstance(call.args, str) else json.dumps(call.args),
            },
        }
        for k, call in enumerate(turn.calls)
    ]
    message: dict[str, Any] = {"role": "assistant", "content": turn.text}
    if calls:
        message["tool_calls"] = calls
    usage: dict[str, Any] = {
        "prompt_tokens": turn.input_tokens,
        "completion_tokens": turn.output_tokens,
        "total_tokens": turn.input_tokens + turn.output_tokens,
    }
    if turn.cache_read or turn.cache_write:
        usage["prompt_tokens_details"] = {"cached_tokens": turn.cache_read, "cache_write_tokens": turn.cache_write}
    return {
        "id": f"chatcmpl-{number}",
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": turn.model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": turn.finish or ("tool_calls" if calls else "stop"),
            }
        ],
        "usage": usage,
    }


def _anthropic_message(turn: Turn, number: int) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if turn.text:
        content.append({"type": "text", "text": turn.text})
    for k, call in enumerate(turn.calls):
        call_id = f"toolu_fake_{number}_{k}" if call.id is None else call.id
        content.append({"type": "tool_use", "id": call_id, "name": call.name, "input": call.args})
    # Anthropic's input_tokens leaves out the cached part; the turn's input_tokens is the whole prompt.
    uncached = turn.input_tokens - turn.cache_read - turn.cache_write
    return {
        "id": f"msg_{number}",
        "type": "message",
        "role": "assistant",
        "model": turn.model,
        "content": content,
        "stop_reason": turn.finish or ("tool_use" if turn.calls else "end_turn"),
        "stop_sequence": None,
        "usage": {
            "input_tokens": uncached,
            "output_tokens": turn.output_tokens,
            "cache_read_input_tokens": turn.cache_read,
            "cache_creation_input_tokens": turn.cache_write,
        },
    }


#: Characters of text, and of argument JSON, per streamed delta.
TEXT_PIECE = 4
ARGS_PIECE = 6


def _pieces(text: str, size: int) -> list[str]:
    return [text[k : k + size] for k in range(0, len(text), size)]


def _args_text(call: Call) -> str:
    return call.args if isinstance(call.args, str) else json.dumps(call.args)


def _openai_events(turn: Turn, number: int, include_usage: bool) -> list[bytes]:
    """The SSE frames of a streamed chat completion: role, content pieces, call fragments, finish, usage, [DONE]."""
    completion = _openai_completion(turn, number)
    usage = completion["usage"]
    head = {
        "id": completion["id"],
        "object": "chat.completion.chunk",
        "created": completion["created"],
        "model": turn.model,
        "system_fingerprint": None,
    }

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return _sse(None, {**head, "choices": [choice], **({"usage": None} if include_usage else {})})

    frames = [chunk({"role": "assistant", "content": "" if turn.text else None, "refusal": None})]
    frames.extend(chunk({"content": piece}) for piece in _pieces(turn.text or "", TEXT_PIECE))
    for k, call in enumerate(completion["choices"][0]["message"].get("tool_calls") or ()):
        frames.append(
            chunk(
                {
                    "tool_calls": [
                        {
                            "index": k,
                            "id": call["id"],
                            "type": "function",
                            "function": {"name": call["function"]["name"], "arguments": ""},
                        }
                    ]
                }
            )
        )
        frames.extend(
            chunk({"tool_calls": [{"index": k, "function": {"arguments": piece}}]})
            for piece in _pieces(call["function"]["arguments"], ARGS_PIECE)
        )
    frames.append(chunk({}, completion["choices"][0]["finish_reason"]))
    if include_usage:
        frames.append(_sse(None, {**head, "choices": [], "usage": usage}))
    frames.append(b"data: [DONE]\n\n")
    return frames


def _anthropic_events(turn: Turn, number: int) -> list[bytes]:
    """The SSE frames of a streamed Messages answer, from ``message_start`` to ``message_stop``."""
    message = _anthropic_message(turn, number)
    usage = message["usage"]
    start = {**message, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 1}}
    frames = [_sse("message_start", {"type": "message_start", "message": start}), _sse("ping", {"type": "ping"})]
    for index, block in enumerate(message["content"]):
        if block["type"] == "text":
            frames.append(
                _sse(
                    "content_block_start",
                    {"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}},
                )
            )
            deltas = [{"type": "text_delta", "text": piece} for piece in _pieces(block["text"], TEXT_PIECE)]
        else:
            opening = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            frames.append(
                _sse("content_block_start", {"type": "content_block_start", "index": index, "content_block": opening})
            )
            text = block["input"] if isinstance(block["input"], str) else json.dumps(block["input"])
            deltas = [{"type": "input_json_delta", "partial_json": piece} for piece in ["", *_pieces(text, ARGS_PIECE)]]
        frames.extend(
            _sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
            for delta in deltas
        )
        frames.append(_sse("content_block_stop", {"type": "content_block_stop", "index": index}))
    # The final counts come on message_delta; the prompt's stay those of message_start.
    frames.append(
        _sse(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
                "usage": {"output_tokens": usage["output_tokens"]},
            },
        )
    )
    frames.append(_sse("message_stop", {"type": "message_stop"}))
    return frames


def _sse(event: str | None, data: dict[str, Any]) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data)}\n\n".encode()


def _stream_error(api: Api, failure: Failure) -> bytes:
    body = _error_body(api, failure)
    return _sse("error", body) if api == "anthropic" else _sse(None, body)


def _error_body(api: Api, failure: Failure) -> dict[str, Any]:
    if api == "openai":
        kind = _OPENAI_ERROR_TYPES.get(failure.status, "server_error")
        return {"error": {"message": failure.message, "type": kind, "param": None, "code": failure.code}}
    kind = failure.code or _ANTHROPIC_ERROR_TYPES.get(failure.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": failure.message}}


class FakeProviderServer:
    """Answers ``/v1/chat/completions`` and ``/v1/messages`` from a queue of replies, then a script.

    ``queue`` replies are used first, one per request; then ``script(api, body)``; with neither, a
    400 says nothing was scripted. ``requests`` records every request as it arrives.
    """

    def __init__(self) -> None:
        self.requests: list[Request] = []
        #: What each ``Hold`` saw: ``"client-closed"`` or ``"timed-out"``.
        self.held: list[str] = []
        self.script: Script | None = None
        self.expected_key: str | None = None
        self._queue: list[Reply] = []
        self._lock = threading.Lock()
        self._count = 0
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._server.block_on_close = False
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-provider", daemon=True)

    @property
    def port(self) -> int:
        """The port it listens on."""
        return int(self._server.server_address[1])

    @property
    def openai_url(self) -> str:
        """``base_url`` for an OpenAI client."""
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def anthropic_url(self) -> str:
        """``base_url`` for an Anthropic client."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeProviderServer:
        """Serve in a background thread."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self._server.shutdown()
        self._server.server_close()

    def reset(self) -> None:
        """Forget requests, queued replies, the script and the expected key."""
        with self._lock:
            self.requests.clear()
            self.held.clear()
            self._queue.clear()
            self.script = None
            self.expected_key = None

    def queue(self, *replies: Reply) -> None:
        """Answer the next requests with ``replies``, in order."""
        with self._lock:
            self._queue.extend(replies)

    def note_hold(self, outcome: str) -> None:
        """Record how a ``Hold`` ended."""
        with self._lock:
            self.held.append(outcome)

    def requests_for(self, first_user_text: str) -> list[Request]:
        """Requests of one conversation (by its first user message)."""
        with self._lock:
            return [r for r in self.requests if r.first_user_text.startswith(first_user_text)]

    def _next(self, request: Request) -> tuple[Reply, int]:
        with self._lock:
            self.requests.append(request)
            self._count += 1
            number = self._count
            if self._queue:
                return self._queue.pop(0), number
            script = self.script
        if script is not None:
            return script(request.api, request.body), number
        return Failure(400, "fake server: no reply scripted for this request"), number

    def _auth_failure(self, request: Request) -> Failure | None:
        if self.expected_key is None:
            return None
        given = request.headers.get("x-api-key") or request.headers.get("authorization", "").removeprefix("Bearer ")
        if given == self.expected_key:
            return None
        # Like the real APIs, the message echoes (part of) the key it got: the client must scrub it.
        return Failure(401, f"Incorrect API key provided: {given}.", code="invalid_api_key")

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        return type("Handler", (_Handler,), {"fake": self})


class _Handler(BaseHTTPRequestHandler):
    """Answers the requests of one connection for the ``fake`` server it is bound to."""

    protocol_version = "HTTP/1.1"
    fake: FakeProviderServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        api: Api
        if self.path.endswith("/chat/completions"):
            api = "openai"
        elif self.path.endswith("/v1/messages"):
            api = "anthropic"
        else:
            self._send(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})
            return
        length = int(self.headers.get("content-length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        request = Request(api, self.path, {k.lower(): v for k, v in self.headers.items()}, body)
        reply, number = self.fake._next(request)
        reply = self.fake._auth_failure(request) or reply
        try:
            self._answer(api, reply, number, body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (its timeout); nothing to answer

    def _answer(self, api: Api, reply: Reply, number: int, body: dict[str, Any]) -> None:
        while isinstance(reply, Slow):
            time.sleep(reply.seconds)
            reply = reply.reply
        if body.get("stream") is True and isinstance(reply, Turn | Cut | Hold | Paced | StreamFailure):
            self._stream(api, reply, number, body)
            return
        if isinstance(reply, Hangup | Cut):
            self._hang_up()
            return
        if isinstance(reply, StreamFailure):
            reply = reply.failure
        if isinstance(reply, Failure):
            self._send(reply.status, _error_body(api, reply), reply.headers)
            return
        turn = reply if isinstance(reply, Turn) else reply.reply
        payload = _openai_completion(turn, number) if api == "openai" else _anthropic_message(turn, number)
        self._send(200, payload, {"x-request-id": f"req_{number}", "request-id": f"req_{number}"})

    def _hang_up(self) -> None:
        self.close_connection = True
        self.connection.shutdown(socket.SHUT_RDWR)

    def _stream(
        self, api: Api, reply: Turn | Cut | Hold | Paced | StreamFailure, number: int, body: dict[str, Any]
    ) -> None:
        turn = reply if isinstance(reply, Turn) else reply.reply
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        frames = _openai_events(turn, number, include_usage) if api == "openai" else _anthropic_events(turn, number)
        self.send_response(200)
        for name, value in {
            "content-type": "text/event-stream; charset=utf-8",
            "cache-control": "no-cache",
            "transfer-encoding": "chunked",
            "x-request-id": f"req_{number}",
            "request-id": f"req_{number}",
        }.items():
            self.send_header(name, value)
        self.end_headers()
        after = len(frames) if isinstance(reply, Turn | Paced) else reply.after
        for frame in frames[:after]:
            if isinstance(reply, Paced):
                time.sleep(reply.interval)
            self._chunk(frame)
        if isinstance(reply, Cut) and not reply.clean:
            self._hang_up()
            return
        if isinstance(reply, StreamFailure):
            self._chunk(_stream_error(api, reply.failure))
        elif isinstance(reply, Hold):
            if self._wait_for_close(reply.seconds):
                return
            for frame in frames[after:]:
                self._chunk(frame)
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _wait_for_close(self, seconds: float) -> bool:
        # The client sends nothing more on this connection until the answer ends: readable means closed.
        readable, _, _ = select.select([self.connection], [], [], seconds)
        try:
            closed = bool(readable) and not self.connection.recv(1, socket.MSG_PEEK)
        except ConnectionResetError:
            closed = True
        self.fake.note_hold("client-closed" if closed else "timed-out")
        self.close_connection = closed
        return closed

    def _send(self, status: int, payload: dict[str, Any], headers: Mapping[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)


def by_turn(*turns: Reply) -> Script:
    """A script answering turn N (N assistant turns already in the transcript) with ``turns[N]``."""

    def answer(api: Api, body: dict[str, Any]) -> Reply:
        done = sum(1 for m in body.get("messages") or () if m.get("role") == "assistant")
        if done < len(turns):
            return turns[done]
        return Failure(400, f"fake server: no scripted turn {done + 1}")

    return answer
