"""Runs on real providers' wire formats, stepped in-process on the real Postgres and Redis.

The models are the real ``OpenAIModel`` and ``AnthropicModel`` pointed at the fake server; the step
executor, checkpoints and leases are the production ones. Each failure class either retries (a
``FAILED`` step with a countdown, then success) or parks the run (``PARKED``, not retryable, listed
as pending, left alone by the recovery sweep).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest

from producer.client import Client
from store import errors
from store.checkpoints import PostgresCheckpointStore
from store.records import Usage
from tests.fakes.provider_server import Api, Call, Failure, FakeProviderServer, Hangup, Reply, Slow, Turn, by_turn
from tests.support.driver import Driver
from worker import Agent, tool
from worker.providers.anthropic import AnthropicModel
from worker.providers.openai import OpenAIModel
from worker.steps import Outcome

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("no_real_providers")]

PROVIDERS = ["openai", "anthropic"]
MakeModel = Callable[..., OpenAIModel | AnthropicModel]
MakeDriver = Callable[..., Driver]

looked_up: list[str] = []


@tool
def lookup(city: str) -> str:
    """Weather of a city."""
    looked_up.append(city)
    return f"sunny in {city}"


@pytest.fixture(autouse=True)
def _forget_lookups() -> None:
    looked_up.clear()


def _agent(model: OpenAIModel | AnthropicModel) -> Agent:
    return Agent(
        name=f"weather-{model.model_id.split(':')[0]}", model=model, instructions="Report the weather.", tools=[lookup]
    )


def _results(request_messages: list[dict[str, Any]], api: Api) -> list[dict[str, Any]]:
    """Tool results in a request, in each API's own shape."""
    if api == "openai":
        return [m for m in request_messages if m["role"] == "tool"]
    return [
        b
        for m in request_messages
        if isinstance(m["content"], list)
        for b in m["content"]
        if b["type"] == "tool_result"
    ]


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_three_turn_tool_conversation_runs_end_to_end_and_sums_usage(
    provider: str, server: FakeProviderServer, make_model: MakeModel, make_driver: MakeDriver, client: Client
) -> None:
    server.script = by_turn(
        Turn(
            calls=(Call("lookup", {"city": "Oslo"}), Call("lookup", {"city": "Rome"})),
            input_tokens=100,
            output_tokens=20,
        ),
        Turn(
            calls=(Call("lookup", {"city": "Lima"}),),
            input_tokens=160,
            output_tokens=10,
            cache_read=100,
            cache_write=50,
        ),
        Turn(text="Sunny in Oslo, Rome and Lima.", input_tokens=200, output_tokens=8, cache_read=150),
    )
    agent = _agent(make_model(provider))
    driver = make_driver(agent)
    session_id = f"{provider}-three-turns"

    run = client.agent(agent.name).send("Weather in Oslo, Rome and Lima?", session_id=session_id)
    driver.drain(session_id)
    result = run.wait(timeout=5)

    assert result.finish_reason == "stop" and result.text == "Sunny in Oslo, Rome and Lima." and result.steps == 3
    assert [m.role for m in result.messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    assert looked_up == ["Oslo", "Rome", "Lima"]
    calls = [c.id for c in result.tool_calls]
    assert [m.tool_call_id for m in result.messages if m.role == "tool"] == calls and len(set(calls)) == 3
    assert result.usage == Usage(
        input_tokens=460, output_tokens=38, total_tokens=498, cache_read_tokens=250, cache_write_tokens=50
    )
    # The provider saw its own call ids come back with their results, in its own wire shape.
    assert len(server.requests) == 3
    last = server.requests[-1]
    id_field = "tool_call_id" if provider == "openai" else "tool_use_id"
    assert [r[id_field] for r in _results(last.messages, provider)] == calls  # type: ignore[arg-type]
    checkpoint = client.store.load(session_id)
    assert checkpoint is not None and checkpoint.fingerprint is not None
    assert checkpoint.fingerprint["model"] == f"{provider}:{'gpt-test' if provider == 'openai' else 'claude-test'}"


@pytest.mark.parametrize("provider", PROVIDERS)
def test_malformed_arguments_become_an_error_result_the_model_corrects(
    provider: str, server: FakeProviderServer, make_model: MakeModel, make_driver: MakeDriver, client: Client
) -> None:
    seen: list[list[dict[str, Any]]] = []

    def script(api: Api, body: dict[str, Any]) -> Reply:
        seen.append(body["messages"])
        turn = sum(1 for m in body["messages"] if m["role"] == "assistant")
        if turn == 0:
            return Turn(calls=(Call("lookup", '{"city": "Oslo"'),))
        if turn == 1:
            return Turn(calls=(Call("lookup", {"city": "Oslo"}),))
        return Turn(text="Sunny in Oslo.")

    server.script = script
    agent = _agent(make_model(provider))
    driver = make_driver(agent)
    run = client.agent(agent.name).send("Weather in Oslo?", session_id=f"{provider}-malformed")
    outcomes = driver.drain(f"{provider}-malformed")
    result = run.wait(timeout=5)

    assert Outcome.FAILED not in outcomes and Outcome.PARKED not in outcomes
    assert result.text == "Sunny in Oslo." and looked_up == ["Oslo"]
    first_call, second_call = result.tool_calls
    assert first_call.invalid_args == '{"city": "Oslo"' and second_call.args == {"city": "Oslo"}
    error_result = next(m for m in result.messages if m.role == "tool")
    assert error_result.is_error and json.loads(error_result.content)["kind"] == "validation"
    # The second request showed the model its own broken call and the validation error.
    [sent_result] = _results(seen[1], provider)  # type: ignore[arg-type]
    sent_text = sent_result["content"] if isinstance(sent_result["content"], str) else json.dumps(sent_result)
    assert "ToolArgsInvalid" in sent_text
    if provider == "openai":
        assert seen[1][-2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"'
    else:
        assert sent_result["is_error"] is True


#: Retryable failure classes: (provider, first reply, the least countdown the step must ask for). Both
#: providers' SDK errors are classified alike (``test_models``); here each class runs once, end to end.
RETRIED: dict[str, tuple[str, Reply, float]] = {
    "429-retry-after": ("openai", Failure(429, "Rate limit reached", headers={"retry-after": "1"}), 1.0),
    "500": ("anthropic", Failure(500, "internal error"), 0.0),
    "529-overloaded": ("anthropic", Failure(529, "Overloaded"), 0.0),
    "503": ("openai", Failure(503, "unavailable"), 0.0),
    "timeout": ("openai", Slow(1.0, Turn(text="too late")), 0.0),
    "connection": ("anthropic", Hangup(), 0.0),
}


@pytest.mark.parametrize("case", list(RETRIED))
def test_a_retryable_failure_fails_the_step_with_a_countdown_then_the_retry_succeeds(
    case: str,
    server: FakeProviderServer,
    make_model: MakeModel,
    make_driver: MakeDriver,
    client: Client,
    store: PostgresCheckpointStore,
) -> None:
    provider, reply, least_countdown = RETRIED[case]
    server.queue(reply)
    server.script = by_turn(Turn(text="Recovered.", input_tokens=30, output_tokens=4))
    agent = _agent(make_model(provider, timeout=0.3))
    driver = make_driver(agent)
    session_id = f"{provider}-retry-{case}"
    run = client.agent(agent.name).send("Weather?", session_id=session_id)

    assert driver.step(session_id) == Outcome.FAILED
    failed = client.store.load(session_id)
    assert failed is not None and failed.last_error is not None
    assert failed.last_error.retryable and failed.last_error.message.startswith(provider)
    assert driver.queue == [(session_id, failed.seq)] and driver.countdowns[-1] >= least_countdown
    # Were the retry message lost, the recovery sweep would pick the run up once its time has come.
    assert failed.next_attempt_at is not None
    time.sleep(max(0.0, (failed.next_attempt_at - datetime.now(UTC)).total_seconds()) + 0.05)
    assert session_id in {sid for sid, _ in store.stale_runs(0)}

    assert driver.drain() == [Outcome.FINISHED]
    result = run.wait(timeout=5)
    assert result.text == "Recovered." and result.usage.total_tokens == 34
    final = client.store.load(session_id)
    assert final is not None and final.last_error is None and final.attempts == 0


def test_a_rate_limit_is_reported_as_such(
    server: FakeProviderServer, make_model: MakeModel, make_driver: MakeDriver, client: Client
) -> None:
    server.queue(Failure(429, "Rate limit reached", headers={"retry-after": "2"}))
    agent = _agent(make_model("openai"))
    driver = make_driver(agent)
    client.agent(agent.name).send("Weather?", session_id="openai-rate-limited")
    assert driver.step("openai-rate-limited") == Outcome.FAILED
    checkpoint = client.store.load("openai-rate-limited")
    assert checkpoint is not None and checkpoint.last_error is not None
    assert checkpoint.last_error.code == "LOUSHO_PROVIDER_RATE_LIMITED" and checkpoint.last_error.retryable
    assert len(driver.countdowns) == 1 and 2.0 <= driver.countdowns[0] <= 2.2  # Retry-After, plus jitter


#: Failure classes that park the run: (provider, reply, category named in the message).
PARKED: dict[str, tuple[str, Reply, str]] = {
    "400": ("openai", Failure(400, "messages: invalid"), "invalid-request"),
    "401": ("anthropic", Failure(401, "invalid x-api-key"), "auth"),
    "403": ("openai", Failure(403, "permission denied"), "auth"),
    "404": ("anthropic", Failure(404, "model not found"), "not-found"),
    "context-length-openai": (
        "openai",
        Failure(400, "This model's maximum context length is 8192 tokens", code="context_length_exceeded"),
        "context-length",
    ),
    "context-length-anthropic": (
        "anthropic",
        Failure(400, "prompt is too long: 250000 tokens > 200000 maximum"),
        "context-length",
    ),
}


@pytest.mark.parametrize("case", list(PARKED))
def test_a_non_retryable_failure_parks_the_run_as_pending_and_out_of_the_sweep(
    case: str,
    server: FakeProviderServer,
    make_model: MakeModel,
    make_driver: MakeDriver,
    client: Client,
    store: PostgresCheckpointStore,
) -> None:
    provider, reply, category = PARKED[case]
    server.queue(reply)
    agent = _agent(make_model(provider))
    driver = make_driver(agent)
    session_id = f"{provider}-parked-{case}"
    run = client.agent(agent.name).send("Weather?", session_id=session_id)

    assert driver.step(session_id) == Outcome.PARKED
    assert driver.queue == []
    parked = client.store.load(session_id)
    assert parked is not None and parked.status == "in-progress" and parked.last_error is not None
    assert parked.last_error.code == "LOUSHO_PROVIDER_REQUEST_FAILED" and not parked.last_error.retryable
    assert parked.last_error.message.startswith(f"{provider}: {category}")
    [pending] = client.agent(agent.name).pending()
    assert pending.session_id == session_id and pending.last_error == parked.last_error
    assert session_id not in {sid for sid, _ in store.stale_runs(0)}
    with pytest.raises(errors.ProviderError) as caught:
        run.wait(timeout=1)
    assert not caught.value.retryable
    # A late or duplicate message does not call the provider again.
    assert driver.step(session_id) == Outcome.IDLE and len(server.requests) == 1


def test_a_failure_that_keeps_coming_is_retried_past_the_attempts_cap_and_parked_after_the_budget(
    server: FakeProviderServer, make_model: MakeModel, make_driver: MakeDriver, client: Client
) -> None:
    server.script = lambda api, body: Failure(503, "unavailable")
    agent = _agent(make_model("openai"))
    driver = make_driver(agent, max_attempts=2)
    client.agent(agent.name).send("Weather?", session_id="openai-keeps-failing")

    # The attempts cap (2) is for steps that die; recorded provider failures go on being retried.
    retried = driver.drain("openai-keeps-failing")
    assert retried == [Outcome.FAILED] * len(retried) and len(retried) > 2
    assert len(server.requests) == len(retried)
    # Once the retry budget is spent, the next failure parks the run.
    driver.deps.retry_for_s = 0.0
    assert driver.drain("openai-keeps-failing") == [Outcome.PARKED]
    checkpoint = client.store.load("openai-keeps-failing")
    assert checkpoint is not None and checkpoint.last_error is not None
    assert not checkpoint.last_error.retryable and "LOUSHO_RETRY_FOR_S is 0" in checkpoint.last_error.message
    assert len(server.requests) == len(retried) + 1


def test_usage_sums_the_answered_turns_across_a_failed_attempt(
    server: FakeProviderServer, make_model: MakeModel, make_driver: MakeDriver, client: Client
) -> None:
    server.queue(
        Turn(calls=(Call("lookup", {"city": "Oslo"}),), input_tokens=50, output_tokens=10),
        Failure(500, "blip"),
        Turn(text="Sunny.", input_tokens=70, output_tokens=3, cache_read=40),
    )
    agent = _agent(make_model("anthropic"))
    driver = make_driver(agent)
    run = client.agent(agent.name).send("Weather in Oslo?", session_id="anthropic-usage")
    assert driver.drain("anthropic-usage") == [Outcome.ADVANCED, Outcome.ADVANCED, Outcome.FAILED, Outcome.FINISHED]
    assert run.wait(timeout=5).usage == Usage(
        input_tokens=120, output_tokens=13, total_tokens=133, cache_read_tokens=40
    )


def test_a_parked_run_finishes_once_resumed_after_the_cause_is_fixed(
    server: FakeProviderServer, make_model: MakeModel, make_driver: MakeDriver, client: Client
) -> None:
    server.queue(Failure(401, "invalid x-api-key"))
    agent = _agent(make_model("anthropic"))
    driver = make_driver(agent)
    client.agent(agent.name).send("Weather?", session_id="anthropic-fixed")
    assert driver.step("anthropic-fixed") == Outcome.PARKED

    # The operator fixes the key on the provider's side, then resumes the run.
    server.script = by_turn(Turn(text="Sunny."))
    run = client.agent(agent.name).resume("anthropic-fixed")
    assert run is not None
    assert driver.drain("anthropic-fixed") == [Outcome.FINISHED]
    assert run.wait(timeout=5).text == "Sunny."
    assert client.agent(agent.name).pending() == []
