"""A local HTTP server that speaks enough Chat Completions and Messages API for the real SDK clients.

Tests script its answers (turns, HTTP failures, slow answers, hang-ups) and read back every request
it got. It listens on 127.0.0.1 on a free port; nothing here reaches the network.
"""

from __future__ import annotations

import json
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


Reply = Turn | Failure | Slow | Hangup
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


_OPENAI_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_error",
                       404: "invalid_request_error", 429: "requests", 500: "server_error"}
_ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                          500: "api_error", 529: "overloaded_error"}


def _openai_completion(turn: Turn, number: int) -> dict[str, Any]:
    calls = [{"id": f"call_fake_{number}_{k}" if call.id is None else call.id, "type": "function",
              "function": {"name": call.name,
                           "arguments": call.args if isinstance(call.args, str) else json.dumps(call.args)}}
             for k, call in enumerate(turn.calls)]
    message: dict[str, Any] = {"role": "assistant", "content": turn.text}
    if calls:
        message["tool_calls"] = calls
    usage: dict[str, Any] = {"prompt_tokens": turn.input_tokens, "completion_tokens": turn.output_tokens,
                             "total_tokens": turn.input_tokens + turn.output_tokens}
    if turn.cache_read or turn.cache_write:
        usage["prompt_tokens_details"] = {"cached_tokens": turn.cache_read, "cache_write_tokens": turn.cache_write}
    return {"id": f"chatcmpl-{number}", "object": "chat.completion", "created": 1_700_000_000, "model": turn.model,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": turn.finish or ("tool_calls" if calls else "stop")}],
            "usage": usage}


def _anthropic_message(turn: Turn, number: int) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if turn.text:
        content.append({"type": "text", "text": turn.text})
    for k, call in enumerate(turn.calls):
        call_id = f"toolu_fake_{number}_{k}" if call.id is None else call.id
        content.append({"type": "tool_use", "id": call_id, "name": call.name, "input": call.args})
    # Anthropic's input_tokens leaves out the cached part; the turn's input_tokens is the whole prompt.
    uncached = turn.input_tokens - turn.cache_read - turn.cache_write
    return {"id": f"msg_{number}", "type": "message", "role": "assistant", "model": turn.model,
            "content": content, "stop_reason": turn.finish or ("tool_use" if turn.calls else "end_turn"),
            "stop_sequence": None,
            "usage": {"input_tokens": uncached, "output_tokens": turn.output_tokens,
                      "cache_read_input_tokens": turn.cache_read, "cache_creation_input_tokens": turn.cache_write}}


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
            self._queue.clear()
            self.script = None
            self.expected_key = None

    def queue(self, *replies: Reply) -> None:
        """Answer the next requests with ``replies``, in order."""
        with self._lock:
            self._queue.extend(replies)

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
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

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
                reply, number = server._next(request)
                reply = server._auth_failure(request) or reply
                try:
                    self._answer(api, reply, number)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (its timeout); nothing to answer

            def _answer(self, api: Api, reply: Reply, number: int) -> None:
                while isinstance(reply, Slow):
                    time.sleep(reply.seconds)
                    reply = reply.reply
                if isinstance(reply, Hangup):
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if isinstance(reply, Failure):
                    self._send(reply.status, _error_body(api, reply), reply.headers)
                    return
                payload = _openai_completion(reply, number) if api == "openai" else _anthropic_message(reply, number)
                self._send(200, payload, {"x-request-id": f"req_{number}", "request-id": f"req_{number}"})

            def _send(self, status: int, payload: dict[str, Any], headers: Mapping[str, str] | None = None) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

        return Handler


def by_turn(*turns: Reply) -> Script:
    """A script answering turn N (N assistant turns already in the transcript) with ``turns[N]``."""
    def answer(api: Api, body: dict[str, Any]) -> Reply:
        done = sum(1 for m in body.get("messages") or () if m.get("role") == "assistant")
        if done < len(turns):
            return turns[done]
        return Failure(400, f"fake server: no scripted turn {done + 1}")
    return answer
