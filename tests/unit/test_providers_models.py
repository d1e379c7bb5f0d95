"""``OpenAIModel`` and ``AnthropicModel`` with the real SDK clients against the local fake server."""

from __future__ import annotations

import email.utils
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest

from store import errors
from store.records import Message, ToolCall, Usage
from tests.fakes.provider_server import Call, Failure, FakeProviderServer, Hangup, Reply, Slow, Turn
from tests.support.provider_fixtures import TEST_KEY
from worker.providers.anthropic import AnthropicModel
from worker.providers.base import ToolSpec
from worker.providers.openai import OpenAIModel

pytestmark = pytest.mark.usefixtures("no_real_providers")

MakeModel = Callable[..., OpenAIModel | AnthropicModel]
PROVIDERS = ["openai", "anthropic"]
LOOKUP = ToolSpec(
    name="lookup",
    description="Weather of a city.",
    input_schema={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
QUESTION = [Message(role="system", content="Be brief."), Message(role="user", content="Weather in Oslo?")]


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_turn_with_tool_calls_comes_back_with_ids_args_usage_and_model(
    provider: str, server: FakeProviderServer, make_model: MakeModel
) -> None:
    server.queue(
        Turn(
            text="Let me look.",
            calls=(Call("lookup", {"city": "Oslo"}, id="call_x1"), Call("lookup", '{"city": "Ro', id="call_x2")),
            input_tokens=120,
            output_tokens=30,
            cache_read=100,
            cache_write=20,
            model="fake-2025-01",
        )
    )
    response = make_model(provider).generate(QUESTION, [LOOKUP])
    assert response.text == "Let me look."
    assert response.tool_calls == [
        ToolCall(id="call_x1", name="lookup", args={"city": "Oslo"}),
        ToolCall(id="call_x2", name="lookup", invalid_args='{"city": "Ro'),
    ]
    assert response.usage == Usage(
        input_tokens=120, output_tokens=30, total_tokens=150, cache_read_tokens=100, cache_write_tokens=20
    )
    assert response.finish_reason == ("tool_calls" if provider == "openai" else "tool_use")
    assert response.model_id == "fake-2025-01"


def test_openai_request_carries_transcript_tools_settings_and_key(
    server: FakeProviderServer, make_model: MakeModel
) -> None:
    server.queue(Turn(text="Sunny."))
    model = make_model("openai", temperature=0.2, parallel_tool_calls=True)
    transcript = [
        *QUESTION,
        Message(role="assistant", tool_calls=[ToolCall(id="c1", name="lookup", args={"city": "Oslo"})]),
        Message(role="tool", tool_call_id="c1", name="lookup", content="sunny"),
    ]
    model.generate(transcript, [LOOKUP])
    [request] = server.requests
    assert request.path == "/v1/chat/completions"
    assert request.headers["authorization"] == f"Bearer {TEST_KEY}"
    assert request.body["model"] == "gpt-test" and request.body["temperature"] == 0.2
    assert request.body["parallel_tool_calls"] is True and "stream" not in request.body
    assert request.body["tools"] == [
        {
            "type": "function",
            "function": {"name": "lookup", "description": "Weather of a city.", "parameters": LOOKUP.input_schema},
        }
    ]
    assert request.messages[2:] == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"city": "Oslo"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]


def test_anthropic_request_has_system_apart_results_in_a_user_turn_and_max_tokens(
    server: FakeProviderServer, make_model: MakeModel
) -> None:
    server.queue(Turn(text="Sunny."))
    model = make_model("anthropic", temperature=0.0, max_tokens=512)
    transcript = [
        *QUESTION,
        Message(
            role="assistant",
            tool_calls=[
                ToolCall(id="toolu_1", name="lookup", args={"city": "Oslo"}),
                ToolCall(id="toolu_2", name="lookup", args={"city": "Rome"}),
            ],
        ),
        Message(role="tool", tool_call_id="toolu_1", name="lookup", content="sunny"),
        Message(role="tool", tool_call_id="toolu_2", name="lookup", content="boom", is_error=True),
    ]
    model.generate(transcript, [LOOKUP])
    [request] = server.requests
    assert request.path == "/v1/messages"
    assert TEST_KEY in (request.headers.get("x-api-key", ""), request.headers.get("authorization", "")[7:])
    assert request.body["system"] == "Be brief." and request.body["max_tokens"] == 512
    assert request.body["tools"] == [
        {"name": "lookup", "description": "Weather of a city.", "input_schema": LOOKUP.input_schema}
    ]
    assert request.messages[-1] == {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "boom", "is_error": True},
        ],
    }


def test_anthropic_prompt_caching_marks_the_request(server: FakeProviderServer, make_model: MakeModel) -> None:
    server.queue(Turn(text="ok"))
    make_model("anthropic", cache_prompt=True).generate(QUESTION, [LOOKUP])
    body = server.requests[0].body
    assert body["system"][-1]["cache_control"] == {"type": "ephemeral"}
    assert body["tools"][-1]["cache_control"] == {"type": "ephemeral"}
    assert body["messages"][-1]["content"][-1]["cache_control"] == {"type": "ephemeral"}


def test_calls_without_ids_or_with_reused_ids_get_fresh_ones(server: FakeProviderServer, make_model: MakeModel) -> None:
    # A compatible server that numbers calls from zero every turn must not make two calls share an id.
    server.queue(Turn(calls=(Call("lookup", {"city": "Oslo"}, id="call_0"), Call("lookup", {}, id=""))))
    transcript = [
        *QUESTION,
        Message(role="assistant", tool_calls=[ToolCall(id="call_0", name="lookup")]),
        Message(role="tool", tool_call_id="call_0", content="ok"),
    ]
    response = make_model("openai").generate(transcript, [LOOKUP])
    assert [c.id for c in response.tool_calls] == ["call_1_0", "call_1_1"]


# An hour ahead: the table is built at import, and a long test session must not reach the date.
_DATE_IN_AN_HOUR = email.utils.formatdate(time.time() + 3600, usegmt=True)

#: (reply, error code, category, retryable, retry_after) for each failure class.
FAILURES: dict[str, tuple[Reply, str, str, bool, float | None]] = {
    "429-seconds": (
        Failure(429, "Rate limit reached", headers={"retry-after": "2"}),
        "LOUSHO_PROVIDER_RATE_LIMITED",
        "rate-limit",
        True,
        2.0,
    ),
    "429-date": (
        Failure(429, "Rate limit reached", headers={"retry-after": _DATE_IN_AN_HOUR}),
        "LOUSHO_PROVIDER_RATE_LIMITED",
        "rate-limit",
        True,
        None,
    ),
    "500": (Failure(500, "internal"), "LOUSHO_PROVIDER_REQUEST_FAILED", "server", True, None),
    "503-retry-after": (
        Failure(503, "unavailable", headers={"retry-after": "1"}),
        "LOUSHO_PROVIDER_REQUEST_FAILED",
        "server",
        True,
        1.0,
    ),
    "529-overloaded": (Failure(529, "Overloaded"), "LOUSHO_PROVIDER_REQUEST_FAILED", "server", True, None),
    "400": (
        Failure(400, "messages.0.content: required"),
        "LOUSHO_PROVIDER_REQUEST_FAILED",
        "invalid-request",
        False,
        None,
    ),
    "401": (Failure(401, "invalid x-api-key"), "LOUSHO_PROVIDER_REQUEST_FAILED", "auth", False, None),
    "403": (Failure(403, "not allowed"), "LOUSHO_PROVIDER_REQUEST_FAILED", "auth", False, None),
    "404": (Failure(404, "model: no-such-model"), "LOUSHO_PROVIDER_REQUEST_FAILED", "not-found", False, None),
    "422": (Failure(422, "unprocessable"), "LOUSHO_PROVIDER_REQUEST_FAILED", "invalid-request", False, None),
    "context-length": (
        Failure(400, "prompt is too long: 210000 tokens > 200000 maximum", code="context_length_exceeded"),
        "LOUSHO_PROVIDER_REQUEST_FAILED",
        "context-length",
        False,
        None,
    ),
    "hangup": (Hangup(), "LOUSHO_PROVIDER_REQUEST_FAILED", "connection", True, None),
}


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("case", list(FAILURES))
def test_each_failure_class_is_classified_after_exactly_one_request(
    provider: str, case: str, server: FakeProviderServer, make_model: MakeModel
) -> None:
    reply, code, category, retryable, wait = FAILURES[case]
    server.queue(reply)
    with pytest.raises(errors.ProviderError) as caught:
        make_model(provider).generate(QUESTION, [LOOKUP])
    error = caught.value
    assert (error.code, error.category, error.retryable) == (code, category, retryable)
    if case == "429-date":
        assert error.retry_after is not None and 0 < error.retry_after <= 3600
    else:
        assert error.retry_after == wait
    assert error.message.startswith(f"{provider}: {category}") and len(error.message) <= 500
    assert error.__cause__ is None and error.__suppress_context__
    # The SDK's own retries are off: our step policy is the only retry loop.
    assert len(server.requests) == 1


#: The model's request timeout in the slow-answer test.
TIMEOUT_S = 0.3
#: How late past the timeout a loaded 2-core machine may raise it: the SDK's thread woken late, the
#: request written late. The SDK is warmed by one answered request first (client, lazy imports,
#: connection), so only the timed request's own work counts: a few ms when measured, with other
#: crash tests loading both cores. A timeout past twice the one asked for fails.
TIMEOUT_SLACK_S = 0.3
#: The fake server answers this long after the request, past the latest the timeout may trip: a
#: timeout that does not trip shows as an answer, one that trips late as the elapsed time.
ANSWER_AFTER_S = TIMEOUT_S + TIMEOUT_SLACK_S + 0.5


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_slow_answer_past_the_timeout_is_a_retryable_timeout(
    provider: str, server: FakeProviderServer, make_model: MakeModel
) -> None:
    model = make_model(provider, timeout=TIMEOUT_S)
    server.queue(Turn(text="warm"))
    assert model.generate(QUESTION, []).text == "warm"
    server.reset()
    server.queue(Slow(ANSWER_AFTER_S, Turn(text="too late")))
    started = time.monotonic()
    with pytest.raises(errors.ProviderError) as caught:
        model.generate(QUESTION, [])
    elapsed = time.monotonic() - started
    limit = round(TIMEOUT_S + TIMEOUT_SLACK_S, 3)
    print(f"{provider}: timeout of {TIMEOUT_S} s raised after {elapsed:.3f} s (limit {limit} s)")
    assert TIMEOUT_S <= elapsed <= limit, f"timed out after {elapsed:.3f} s"
    assert (caught.value.category, caught.value.retryable) == ("timeout", True)
    assert caught.value.message == f"{provider}: timeout: no answer within {TIMEOUT_S} s"
    assert len(server.requests) == 1


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_refused_connection_is_retryable(provider: str, make_model: MakeModel) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    base = f"http://127.0.0.1:{port}" + ("/v1" if provider == "openai" else "")
    with pytest.raises(errors.ProviderError) as caught:
        make_model(provider, base_url=base).generate(QUESTION, [])
    assert (caught.value.category, caught.value.retryable) == ("connection", True)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_the_key_never_shows_in_errors_or_repr(
    provider: str, server: FakeProviderServer, make_model: MakeModel
) -> None:
    server.expected_key = "sk-the-right-key-000000000"
    server.queue(Turn(text="unused"))
    model = make_model(provider, api_key="sk-wrong-key-but-still-secret-123")
    with pytest.raises(errors.ProviderError) as caught:
        model.generate(QUESTION, [])
    assert (caught.value.category, caught.value.retryable) == ("auth", False)
    assert "wrong-key" not in str(caught.value) and "[redacted]" in str(caught.value)
    assert "wrong-key" not in repr(model) and "wrong-key" not in str(caught.value.to_record())


@pytest.mark.parametrize(("provider", "env_var"), [("openai", "OPENAI_API_KEY"), ("anthropic", "ANTHROPIC_API_KEY")])
def test_the_key_comes_from_the_usual_environment_variable(
    provider: str, env_var: str, server: FakeProviderServer, make_model: MakeModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(env_var, "sk-from-the-environment-42")
    server.expected_key = "sk-from-the-environment-42"
    server.queue(Turn(text="hello"))
    assert make_model(provider, api_key=None).generate(QUESTION, []).text == "hello"


@pytest.mark.parametrize("cls", [OpenAIModel, AnthropicModel])
def test_the_hosted_api_without_a_key_is_a_configuration_error(cls: type[Any]) -> None:
    with pytest.raises(errors.ConfigurationError, match="_API_KEY"):
        cls("some-model")


@pytest.mark.parametrize(("cls", "package"), [(OpenAIModel, "openai"), (AnthropicModel, "anthropic")])
def test_a_missing_sdk_is_a_configuration_error_with_the_install_hint(
    cls: type[Any], package: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, package, None)
    with pytest.raises(errors.ConfigurationError, match=rf"pip install 'lousho-worker\[{package}\]'"):
        cls("some-model", api_key="sk-test-000000")


@pytest.mark.parametrize(
    "options",
    [
        {"stream": True},
        {"messages": []},
        {"timeout": 0},
        {"timeout": "soon"},
        {"client_options": {"max_retries": 3}},
        {"client_options": {"api_key": "x"}},
    ],
)
@pytest.mark.parametrize("cls", [OpenAIModel, AnthropicModel])
def test_settings_that_would_break_the_contract_are_refused(cls: type[Any], options: dict[str, Any]) -> None:
    with pytest.raises(errors.ConfigurationError):
        cls("some-model", api_key="sk-test-000000", **options)


def test_a_local_server_needs_no_key_and_the_model_id_names_the_provider(
    server: FakeProviderServer, make_model: MakeModel
) -> None:
    server.queue(Turn(text="hi"))
    model = make_model("openai", api_key=None, model="llama3.2")
    assert model.generate(QUESTION, []).text == "hi"
    assert model.model_id == "openai:llama3.2"
    assert server.requests[0].headers["authorization"] == "Bearer not-needed"


def test_each_process_builds_its_own_client(make_model: MakeModel, monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_model("openai")
    first = model._client.get()
    assert model._client.get() is first
    # As if in a forked child: a pool inherited from the parent must not be reused.
    monkeypatch.setattr("os.getpid", lambda: -1)
    assert model._client.get() is not first
    first.close()
