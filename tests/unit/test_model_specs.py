"""Model specs: a model as JSON without secrets, and the same model found or built again from it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from store import errors
from store.records import Message
from worker.providers.base import ModelResponse, ToolSpec
from worker.providers.mock import MockModel
from worker.providers.specs import model_from_spec, model_spec

pytest.importorskip("openai")
pytest.importorskip("anthropic")

from worker.providers.anthropic import AnthropicModel
from worker.providers.openai import OpenAIModel

SECRET = "sk-secret"


@pytest.fixture(autouse=True)
def _keys_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env-openai")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-env-anthropic")


def stored(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec as a run's checkpoint gives it back (JSON)."""
    return dict(json.loads(json.dumps(spec)))


class _Custom:
    model_id = "custom-1"

    def generate(self, messages: list[Message], tools: list[ToolSpec]) -> ModelResponse:
        return ModelResponse(text="hi")


class _TunedOpenAI(OpenAIModel):
    pass


@pytest.mark.parametrize(
    "build",
    [
        lambda: OpenAIModel(
            "gpt-4.1-mini",
            api_key=SECRET,
            temperature=0.2,
            extra_headers={"X-Key": SECRET},
            extra_query={"key": SECRET},
            user=f"holds {SECRET}",
            client_options={"organization": "org-1", "default_headers": {"Authorization": SECRET}},
        ),
        lambda: AnthropicModel(
            "claude-test",
            api_key=SECRET,
            max_tokens=512,
            temperature=0.1,
            extra_headers={"x-api-key": SECRET},
            client_options={"default_headers": {"A": "b"}},
        ),
    ],
    ids=["openai", "anthropic"],
)
def test_a_spec_holds_no_key_header_or_client_option(build: Any) -> None:
    spec = model_spec(build())

    text = json.dumps(spec)
    assert SECRET not in text and "org-1" not in text and "Authorization" not in text
    assert "client_options" in spec["left_out"] and "extra_headers" in spec["left_out"]
    assert spec["settings"]["temperature"] in (0.2, 0.1)


def test_an_openai_model_is_built_again_from_its_spec_alone() -> None:
    model = OpenAIModel(
        "gpt-4.1-mini",
        api_key=SECRET,
        base_url="http://127.0.0.1:9/v1",
        timeout=30,
        temperature=0.2,
        stop=("END", "STOP"),
        parallel_tool_calls=False,
    )
    spec = stored(model_spec(model))

    rebuilt = model_from_spec(spec, [])

    assert spec == {
        "provider": "openai",
        "model_id": "openai:gpt-4.1-mini",
        "base_url": "http://127.0.0.1:9/v1",
        "timeout": 30.0,
        "settings": {"temperature": 0.2, "stop": ["END", "STOP"], "parallel_tool_calls": False},
    }
    assert isinstance(rebuilt, OpenAIModel) and rebuilt is not model
    assert (rebuilt.model, rebuilt.base_url, rebuilt.timeout) == ("gpt-4.1-mini", "http://127.0.0.1:9/v1", 30.0)
    assert rebuilt.settings == {"temperature": 0.2, "stop": ["END", "STOP"], "parallel_tool_calls": False}
    assert model_spec(rebuilt) == spec


def test_an_anthropic_model_is_built_again_from_its_spec_alone() -> None:
    model = AnthropicModel("claude-test", api_key=SECRET, max_tokens=512, cache_prompt=True, temperature=0.1)
    spec = stored(model_spec(model))

    rebuilt = model_from_spec(spec, [])

    assert spec == {
        "provider": "anthropic",
        "model_id": "anthropic:claude-test",
        "max_tokens": 512,
        "cache_prompt": True,
        "settings": {"temperature": 0.1},
    }
    assert isinstance(rebuilt, AnthropicModel)
    assert (rebuilt.model, rebuilt.max_tokens, rebuilt.cache_prompt, rebuilt.settings) == (
        "claude-test",
        512,
        True,
        {"temperature": 0.1},
    )
    assert model_spec(rebuilt) == spec


def test_a_candidate_with_the_spec_is_preferred_to_a_new_model() -> None:
    model = OpenAIModel("gpt-4.1-mini", temperature=0.2)
    other = OpenAIModel("gpt-4.1-mini", temperature=0.9)

    assert model_from_spec(stored(model_spec(model)), [other, model]) is model


def test_mock_models_come_back_only_through_candidates_and_are_told_apart_by_model_id() -> None:
    first, second = MockModel(["a"], model_id="mock-a"), MockModel(["b"], model_id="mock-b")
    spec = stored(model_spec(second))

    assert spec == {"provider": "mock", "model_id": "mock-b"}
    assert model_from_spec(spec, [first, second]) is second
    assert model_from_spec(stored(model_spec(first)), [first, second]) is first
    with pytest.raises(errors.ConfigurationError) as raised:
        model_from_spec(spec, [first])
    assert "'mock'" in raised.value.message and "'mock-b'" in raised.value.message
    assert "Agent(models=[...])" in raised.value.message


def test_headers_and_query_parameters_are_left_out_whatever_they_hold() -> None:
    model = OpenAIModel(
        "gpt-4.1-mini", extra_headers={"X-Trace": "trace-1"}, extra_query={"v": "query-1"}, temperature=0.3
    )

    spec = model_spec(model)

    assert "trace-1" not in json.dumps(spec) and "query-1" not in json.dumps(spec)
    assert spec["left_out"] == ["extra_headers", "extra_query"] and spec["settings"] == {"temperature": 0.3}


def test_a_model_with_parts_left_out_of_its_spec_is_not_built_from_it(monkeypatch: pytest.MonkeyPatch) -> None:
    model = OpenAIModel("gpt-4.1-mini", client_options={"organization": "org-1"})
    spec = stored(model_spec(model))
    monkeypatch.delenv("OPENAI_API_KEY")

    # Refused for what it is (a model to list), not for a key it would not use anyway.
    with pytest.raises(errors.ConfigurationError, match=r"Agent\(models="):
        model_from_spec(spec, [])
    assert model_from_spec(spec, [model]) is model


def test_other_model_classes_are_named_by_module_and_class_and_need_a_candidate() -> None:
    custom, tuned = _Custom(), _TunedOpenAI("gpt-4.1-mini")
    custom_spec, tuned_spec = stored(model_spec(custom)), stored(model_spec(tuned))

    assert custom_spec == {"provider": f"{__name__}:_Custom", "model_id": "custom-1"}
    assert tuned_spec["provider"] == f"{__name__}:_TunedOpenAI"
    for spec in (custom_spec, tuned_spec):
        with pytest.raises(errors.ConfigurationError, match="Agent"):
            model_from_spec(spec, [])
    assert model_from_spec(custom_spec, [tuned, custom]) is custom
    assert model_from_spec(tuned_spec, [custom, tuned]) is tuned


def test_a_spec_built_again_without_a_key_in_the_environment_says_which_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = stored(model_spec(OpenAIModel("gpt-4.1-mini", api_key=SECRET)))
    monkeypatch.delenv("OPENAI_API_KEY")

    with pytest.raises(errors.ConfigurationError, match="OPENAI_API_KEY"):
        model_from_spec(spec, [])
