"""``OpenAIModel`` and ``AnthropicModel`` streaming to a listener, against the fake server's real SSE streams."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from store import errors
from store.records import Message, ToolCall, Usage
from tests.fakes.provider_server import (
    TEXT_PIECE,
    Call,
    Cut,
    Failure,
    FakeProviderServer,
    Hold,
    Paced,
    StreamFailure,
    Turn,
)
from tests.unit.test_providers_models import FAILURES, LOOKUP, PROVIDERS, QUESTION
from worker.providers import _failures
from worker.providers.anthropic import AnthropicModel
from worker.providers.base import ModelCallCancelled
from worker.providers.openai import OpenAIModel

pytestmark = pytest.mark.usefixtures("no_real_providers")

MakeModel = Callable[..., OpenAIModel | AnthropicModel]

TEXT = "Let me look that up for you."
TURNS = {
    "text": Turn(text=TEXT, input_tokens=40, output_tokens=9),
    "text-and-calls": Turn(
        text=TEXT,
        calls=(Call("lookup", {"city": "Oslo"}, id="call_x1"), Call("lookup", '{"city": "Ro', id="call_x2")),
        input_tokens=120,
        output_tokens=30,
        cache_read=100,
        cache_write=20,
        model="fake-2025-01",
    ),
    "calls-only": Turn(
        calls=(
            Call("lookup", {"city": "Oslo, Norway", "days": [1, 2, 3]}, id="call_y1"),
            Call("lookup", {}, id="call_y2"),
        ),
        finish="tool_calls",
    ),
}


class RecordingListener:
    """A listener that writes down what it hears; it cancels the call after ``cancel_after`` text deltas."""

    def __init__(self, cancel_after: int | None = None) -> None:
        self.cancelled = threading.Event()
        self.texts: list[str] = []
        self.calls: list[tuple[str, str]] = []
        self._cancel_after = cancel_after

    def text(self, delta: str) -> None:
        self.texts.append(delta)
        if self._cancel_after is not None and len(self.texts) >= self._cancel_after:
            self.cancelled.set()

    def tool_call(self, call_id: str, name: str) -> None:
        self.calls.append((call_id, name))


def wait_for(condition: Callable[[], Any], seconds: float = 5.0) -> Any:
    """``condition()`` once it is truthy (the fake server records from its own threads); fails after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not (value := condition()):
        assert time.monotonic() < deadline, "the fake server did not record it in time"
        time.sleep(0.01)
    return value


def warm_up(model: OpenAIModel | AnthropicModel, server: FakeProviderServer) -> None:
    """One answered streamed call first (client, lazy imports, connection), so a timed call's time is its own."""
    server.queue(TURNS["text"])
    assert model.generate(QUESTION, [], listener=RecordingListener()).text == TEXT
    server.reset()


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("case", list(TURNS))
def test_a_streamed_answer_is_the_same_turn_as_a_plain_one(
    provider: str, case: str, server: FakeProviderServer, make_model: MakeModel
) -> None:
    model = make_model(provider)
    server.queue(TURNS[case], TURNS[case])
    plain = model.generate(QUESTION, [LOOKUP])
    streamed = model.generate(QUESTION, [LOOKUP], listener=RecordingListener())
    assert streamed == plain
    plain_request, streamed_request = server.requests
    assert "stream" not in plain_request.body and "stream_options" not in plain_request.body
    assert streamed_request.body["stream"] is True
    if provider == "openai":
        assert streamed_request.body["stream_options"] == {"include_usage": True}
    assert {k: v for k, v in streamed_request.body.items() if not k.startswith("stream")} == plain_request.body


@pytest.mark.parametrize("provider", PROVIDERS)
def test_the_streamed_turn_keeps_text_calls_usage_finish_reason_and_model(
    provider: str, server: FakeProviderServer, make_model: MakeModel
) -> None:
    server.queue(TURNS["text-and-calls"])
    response = make_model(provider).generate(QUESTION, [LOOKUP], listener=RecordingListener())
    assert response.text == TEXT
    assert response.tool_calls == [
        ToolCall(id="call_x1", name="lookup", args={"city": "Oslo"}),
        ToolCall(id="call_x2", name="lookup", invalid_args='{"city": "Ro'),
    ]
    assert response.usage == Usage(
        input_tokens=120, output_tokens=30, total_tokens=150, cache_read_tokens=100, cache_write_tokens=20
    )
    assert response.finish_reason == ("tool_calls" if provider == "openai" else "tool_use")
    assert response.model_id == "fake-2025-01"


@pytest.mark.parametrize("provider", PROVIDERS)
def test_the_listener_hears_the_text_deltas_in_order_and_each_tool_call_once(
    provider: str, server: FakeProviderServer, make_model: MakeModel
) -> None:
    server.queue(TURNS["text-and-calls"])
    listener = RecordingListener()
    response = make_model(provider).generate(QUESTION, [LOOKUP], listener=listener)
    assert listener.texts == [TEXT[k : k + TEXT_PIECE] for k in range(0, len(TEXT), TEXT_PIECE)]
    # Each call's arguments came in several pieces; the call is still heard of once.
    assert (
        listener.calls
        == [(call.id, call.name) for call in response.tool_calls]
        == [("call_x1", "lookup"), ("call_x2", "lookup")]
    )


@pytest.mark.parametrize("provider", PROVIDERS)
def test_streamed_calls_are_announced_under_the_fresh_ids_the_turn_keeps(
    provider: str, server: FakeProviderServer, make_model: MakeModel
) -> None:
    # A server that numbers calls from zero every turn, or gives none: the listener must hear the ids tools get.
    server.queue(Turn(calls=(Call("lookup", {"city": "Oslo"}, id="call_0"), Call("lookup", {}, id=""))))
    transcript = [
        *QUESTION,
        Message(role="assistant", tool_calls=[ToolCall(id="call_0", name="lookup")]),
        Message(role="tool", tool_call_id="call_0", content="ok"),
    ]
    listener = RecordingListener()
    response = make_model(provider).generate(transcript, [LOOKUP], listener=listener)
    assert [c.id for c in response.tool_calls] == ["call_1_0", "call_1_1"]
    assert listener.calls == [("call_1_0", "lookup"), ("call_1_1", "lookup")]
    assert listener.texts == []


@pytest.mark.parametrize("provider", PROVIDERS)
def test_cancelling_mid_stream_raises_and_closes_the_connection_without_reading_on(
    provider: str, server: FakeProviderServer, make_model: MakeModel
) -> None:
    model = make_model(provider)
    # The server sends the opening events and the first text delta, then holds the rest back until the client
    # hangs up (or 10 s pass, which the test would see as "timed-out").
    opening = 2 if provider == "openai" else 4
    server.queue(Hold(opening, TURNS["text-and-calls"], seconds=10.0))
    listener = RecordingListener(cancel_after=1)
    with pytest.raises(ModelCallCancelled):
        model.generate(QUESTION, [LOOKUP], listener=listener)
    assert listener.texts == [TEXT[:TEXT_PIECE]] and listener.calls == []
    assert wait_for(lambda: server.held) == ["client-closed"]
    # The model's connections are still usable for the next call.
    server.queue(TURNS["text"])
    assert model.generate(QUESTION, [], listener=RecordingListener()).text == TEXT


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_call_cancelled_before_it_starts_sends_no_request(
    provider: str, server: FakeProviderServer, make_model: MakeModel
) -> None:
    listener = RecordingListener()
    listener.cancelled.set()
    server.queue(TURNS["text"])
    with pytest.raises(ModelCallCancelled):
        make_model(provider).generate(QUESTION, [LOOKUP], listener=listener)
    assert server.requests == []


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("case", list(FAILURES))
def test_a_failure_before_the_stream_is_classified_as_for_a_plain_request(
    provider: str, case: str, server: FakeProviderServer, make_model: MakeModel
) -> None:
    reply, code, category, retryable, wait = FAILURES[case]
    server.queue(reply)
    with pytest.raises(errors.ProviderError) as caught:
        make_model(provider).generate(QUESTION, [LOOKUP], listener=RecordingListener())
    error = caught.value
    assert (error.code, error.category, error.retryable) == (code, category, retryable)
    if case == "429-date":
        assert error.retry_after is not None and 0 < error.retry_after <= 3600
    else:
        assert error.retry_after == wait
    assert error.message.startswith(f"{provider}: {category}")
    assert error.__cause__ is None and error.__suppress_context__
    [request] = server.requests
    assert request.body["stream"] is True


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("clean", [False, True], ids=["dropped", "ended-early"])
@pytest.mark.parametrize("after", [1, 6, 12])
def test_a_stream_cut_off_midway_is_a_retryable_connection_failure(
    provider: str, clean: bool, after: int, server: FakeProviderServer, make_model: MakeModel
) -> None:
    server.queue(Cut(after, TURNS["text-and-calls"], clean=clean))
    with pytest.raises(errors.ProviderError) as caught:
        make_model(provider).generate(QUESTION, [LOOKUP], listener=RecordingListener())
    print(f"{provider} cut after {after} events ({'clean' if clean else 'dropped'}): {caught.value.message}")
    assert (caught.value.category, caught.value.retryable) == ("connection", True)
    # No SDK error chained on: those hold the request, whose headers carry the key.
    assert caught.value.__cause__ is None and (caught.value.__suppress_context__ or caught.value.__context__ is None)
    assert len(server.requests) == 1


#: (failure sent as an error event inside the stream, category, retryable) per provider.
STREAM_ERRORS: dict[str, list[tuple[Failure, str, bool]]] = {
    "openai": [
        (Failure(500, "The server had an error"), "server", True),
        (Failure(429, "Rate limit reached", code="rate_limit_exceeded"), "rate-limit", True),
        (
            Failure(400, "This model's maximum context length is 8192 tokens", code="context_length_exceeded"),
            "context-length",
            False,
        ),
        (Failure(400, "Invalid tool schema"), "invalid-request", False),
    ],
    "anthropic": [
        (Failure(529, "Overloaded"), "server", True),
        (Failure(500, "Internal server error"), "server", True),
        (Failure(429, "Number of request tokens has exceeded your rate limit"), "rate-limit", True),
        (Failure(400, "prompt is too long: 210000 tokens > 200000 maximum"), "context-length", False),
        (Failure(400, "tools.0: invalid schema"), "invalid-request", False),
    ],
}


@pytest.mark.parametrize(
    ("provider", "failure", "category", "retryable"),
    [(p, *case) for p, cases in STREAM_ERRORS.items() for case in cases],
)
def test_an_error_event_inside_the_stream_is_classified_by_its_type(
    provider: str, failure: Failure, category: str, retryable: bool, server: FakeProviderServer, make_model: MakeModel
) -> None:
    server.queue(StreamFailure(5, TURNS["text-and-calls"], failure))
    listener = RecordingListener()
    with pytest.raises(errors.ProviderError) as caught:
        make_model(provider).generate(QUESTION, [LOOKUP], listener=listener)
    print(f"{provider}: {caught.value.message}")
    assert (caught.value.category, caught.value.retryable) == (category, retryable)
    assert caught.value.message.startswith(f"{provider}: {category} (in stream: ")
    assert listener.texts, "the error came after some text had streamed"


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_stream_that_stalls_past_the_timeout_is_a_retryable_timeout(
    provider: str, server: FakeProviderServer, make_model: MakeModel
) -> None:
    model = make_model(provider, timeout=0.5)
    warm_up(model, server)
    server.queue(Hold(4, TURNS["text"], seconds=10.0))
    with pytest.raises(errors.ProviderError) as caught:
        model.generate(QUESTION, [], listener=RecordingListener())
    assert (caught.value.category, caught.value.retryable) == ("timeout", True)
    assert caught.value.message == f"{provider}: timeout: no answer within 0.5 s"
    assert wait_for(lambda: server.held) == ["client-closed"]


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_stream_longer_in_all_than_the_timeout_is_a_retryable_timeout(
    provider: str, server: FakeProviderServer, make_model: MakeModel
) -> None:
    # Each event comes well within the timeout, but the whole answer would take several times as long.
    model = make_model(provider, timeout=1.0)
    warm_up(model, server)
    long_answer = Turn(text="word " * 40)
    server.queue(Paced(0.1, long_answer))
    listener = RecordingListener()
    with pytest.raises(errors.ProviderError) as caught:
        model.generate(QUESTION, [], listener=listener)
    assert (caught.value.category, caught.value.retryable) == ("timeout", True)
    assert 0 < len("".join(listener.texts)) < len(long_answer.text or "")


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_refused_key_in_a_streamed_call_is_scrubbed_and_parks(
    provider: str, server: FakeProviderServer, make_model: MakeModel
) -> None:
    server.expected_key = "sk-the-right-key-000000000"
    server.queue(TURNS["text"])
    with pytest.raises(errors.ProviderError) as caught:
        make_model(provider, api_key="sk-wrong-key-but-still-secret-123").generate(
            QUESTION, [], listener=RecordingListener()
        )
    assert (caught.value.category, caught.value.retryable) == ("auth", False)
    assert "wrong-key" not in str(caught.value.to_record())


@pytest.mark.parametrize(
    ("body", "category", "retryable", "status"),
    [
        ({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}, "server", True, 529),
        ({"type": "error", "error": {"type": "api_error", "message": "Internal"}}, "server", True, 500),
        ({"type": "error", "error": {"type": "rate_limit_error", "message": "slow"}}, "rate-limit", True, 429),
        ({"type": "error", "error": {"type": "authentication_error", "message": "bad key"}}, "auth", False, 401),
        (
            {"type": "error", "error": {"type": "invalid_request_error", "message": "prompt is too long"}},
            "context-length",
            False,
            400,
        ),
        ({"message": "over quota", "type": "insufficient_quota", "code": "insufficient_quota"}, "auth", False, 429),
        ({"message": "The server had an error", "type": "server_error", "code": None}, "server", True, 500),
        ({"message": "something new", "type": "brand_new_error"}, "server", True, 500),
        ("not json at all", "server", True, 500),
    ],
)
def test_stream_error_types_stand_for_the_status_they_would_have(
    body: object, category: str, retryable: bool, status: int
) -> None:
    error = _failures.from_stream_error("anthropic", body, secrets=["sk-secret-000000"])
    assert (error.category, error.retryable, error.status) == (category, retryable, status)
    assert error.retry_after is None


def test_the_incomplete_stream_error_is_a_retryable_connection_failure() -> None:
    error = _failures.cut_off("openai", "the stream ended before the answer was complete")
    assert (error.category, error.retryable, error.code) == ("connection", True, "LOUSHO_PROVIDER_REQUEST_FAILED")
