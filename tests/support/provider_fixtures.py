"""Provider-test fixtures: the fake provider server, models pointed at it, and an in-process step driver.

Every test here runs with the provider keys and base URLs removed from the environment and with
connections to anything but loopback refused, so no test can reach a real model.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.fakes.provider_server import FakeProviderServer
from tests.support.driver import Driver, client, make_driver  # noqa: F401  # fixtures for the tests here

pytest.importorskip("openai")
pytest.importorskip("anthropic")

from worker.providers.anthropic import AnthropicModel
from worker.providers.openai import OpenAIModel

#: The key the fake server expects when a test turns the check on.
TEST_KEY = "sk-test-0123456789abcdefghijklmnop"
_PROVIDER_ENV = (
    "OPENAI_API_KEY",
    "OPENAI_BASE_URL",
    "OPENAI_ORG_ID",
    "OPENAI_PROJECT_ID",
    "ANTHROPIC_API_KEY",
    "ANTHROPIC_AUTH_TOKEN",
    "ANTHROPIC_BASE_URL",
    "ANTHROPIC_PROFILE",
    "ANTHROPIC_CONFIG_DIR",
)
_LOOPBACK = {"127.0.0.1", "::1", "localhost"}


@pytest.fixture
def no_real_providers(monkeypatch: pytest.MonkeyPatch) -> None:
    """No provider credentials in the environment, and no connection beyond this machine (the provider tests)."""
    for name in _PROVIDER_ENV:
        monkeypatch.delenv(name, raising=False)
    real_connect = socket.socket.connect

    def connect(sock: socket.socket, address: Any) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in _LOOPBACK:
            raise AssertionError(f"provider tests may not connect to {address[0]}")
        real_connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", connect)


@pytest.fixture(scope="session")
def fake_server() -> Iterator[FakeProviderServer]:
    """The fake provider server, started once."""
    server = FakeProviderServer().start()
    yield server
    server.stop()


@pytest.fixture
def server(fake_server: FakeProviderServer) -> FakeProviderServer:
    """The fake provider server with nothing scripted and no request recorded."""
    fake_server.reset()
    return fake_server


@pytest.fixture
def make_model(server: FakeProviderServer) -> Iterator[Callable[..., OpenAIModel | AnthropicModel]]:
    """``make_model(provider, **options)``: a model of ``provider`` pointed at the fake server."""
    made: list[OpenAIModel | AnthropicModel] = []

    def make(provider: str, **options: Any) -> OpenAIModel | AnthropicModel:
        options.setdefault("api_key", TEST_KEY)
        options.setdefault("timeout", 5.0)
        model: OpenAIModel | AnthropicModel
        if provider == "openai":
            model = OpenAIModel(
                options.pop("model", "gpt-test"), base_url=options.pop("base_url", server.openai_url), **options
            )
        else:
            model = AnthropicModel(
                options.pop("model", "claude-test"), base_url=options.pop("base_url", server.anthropic_url), **options
            )
        made.append(model)
        return model

    yield make
    for model in made:
        model.close()
