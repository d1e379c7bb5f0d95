"""The agent the provider tests run under real ``celery worker`` processes (``tests.support.provider_agents``).

Its model is the real ``OpenAIModel``, pointed at the test's fake server through ``LOUSHO_PROVIDERS_TEST_URL``.
"""

from __future__ import annotations

import os

from worker import Agent, tool
from worker.providers.openai import OpenAIModel

URL_ENV = "LOUSHO_PROVIDERS_TEST_URL"
#: Nothing listens on the discard port: without the variable every call fails as a connection error.
_UNSET_URL = "http://127.0.0.1:9/v1"


@tool
def lookup(city: str) -> str:
    """Weather of a city."""
    return f"sunny in {city}"


weather = Agent(
    name="provider-weather",
    model=OpenAIModel(
        "gpt-test", base_url=os.environ.get(URL_ENV, _UNSET_URL), api_key="sk-test-worker-000000", timeout=5.0
    ),
    instructions="Report the weather.",
    tools=[lookup],
)
