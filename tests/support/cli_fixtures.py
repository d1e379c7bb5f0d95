"""Fixtures for the ``lousho`` tests: the command run in-process on the test services, and runs to show.

``lousho(*argv)`` calls ``producer.cli.main`` with the test services in the environment and returns the
exit status and what was printed. Tests that need Postgres and Redis mark themselves ``integration``;
runs are stepped in this process by the driver of ``tests.support.driver`` (no worker runs).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from producer.cli import main
from producer.client import Client
from tests.support import services
from tests.support.driver import Driver, client, make_driver  # noqa: F401  # fixtures for the tests here
from worker import Agent, Tool, tool
from worker.providers import MockModel


@dataclass(frozen=True)
class Printed:
    """What one ``lousho`` invocation returned and printed."""

    code: int
    out: str
    err: str

    def json(self) -> Any:
        """Stdout parsed as JSON (fails the test when it is not JSON)."""
        return json.loads(self.out)

    def error_code(self) -> str:
        """The ``LOUSHO_...`` code of the error line on stderr (``error CODE: message``)."""
        assert self.err.startswith("error LOUSHO_"), self.err
        return self.err.split(":", 1)[0].removeprefix("error ")


Lousho = Callable[..., Printed]


@pytest.fixture
def lousho(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Lousho:
    """``lousho(*argv)``: run the command in this process on the test services."""
    for name, value in services.test_environment().items():
        monkeypatch.setenv(name, value)

    def run(*argv: str) -> Printed:
        capsys.readouterr()
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse: --version, --help and usage errors
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        printed = capsys.readouterr()
        return Printed(code, printed.out, printed.err)

    return run


@tool
def lookup(city: str) -> str:
    """Weather of a city."""
    return f"sunny in {city}"


def _transfer(amount: int) -> str:
    """Move money."""
    return f"moved {amount}"


transfer = Tool(_transfer, name="transfer", needs_approval=True)


def weather_agent() -> Agent:
    """One tool turn, then the answer (and more answers for follow-up input)."""
    return Agent(
        name="weather",
        model=MockModel(
            [
                {"tool_calls": [{"name": "lookup", "args": {"city": "Oslo"}}]},
                "Sunny in Oslo.",
                "Still sunny.",
                "Sunny again.",
            ]
        ),
        instructions="Report the weather.",
        tools=[lookup],
    )


def bank_agent() -> Agent:
    """A transfer that needs a human's approval, then the answer."""
    return Agent(
        name="bank",
        model=MockModel([{"tool_calls": [{"name": "transfer", "args": {"amount": 10}}]}, "Done.", "Done again."]),
        tools=[transfer],
    )


@pytest.fixture
def weather(make_driver: Callable[..., Driver]) -> Driver:  # noqa: F811  # the fixture imported above
    """A step driver for the ``weather`` agent (registered, so the workers know it)."""
    return make_driver(weather_agent())


@pytest.fixture
def finished(weather: Driver, client: Client) -> str:  # noqa: F811
    """The id of a ``weather`` run that finished (two model turns and a tool batch)."""
    client.agent("weather").send("Weather in Oslo?", session_id="w-1")
    weather.drain("w-1")
    return "w-1"


@pytest.fixture
def paused(make_driver: Callable[..., Driver], client: Client) -> tuple[Driver, str]:  # noqa: F811
    """A ``bank`` run ``b-1`` paused on the approval of a transfer: ``(driver, approval_id)``."""
    driver = make_driver(bank_agent())
    client.agent("bank").send("Move 10", session_id="b-1")
    driver.drain("b-1")
    checkpoint = client.store.load("b-1")
    assert checkpoint is not None and checkpoint.status == "awaiting-approval"
    return driver, checkpoint.approval_ids[0]


def drive_in_background(driver: Driver, session_id: str, ready: Callable[[], bool]) -> threading.Thread:
    """Step ``session_id`` in a thread once ``ready()``, while the command in the test waits for it to settle."""

    def drive() -> None:
        for _ in range(500):
            if ready():
                break
            time.sleep(0.02)
        driver.drain(session_id)

    thread = threading.Thread(target=drive, daemon=True)
    thread.start()
    return thread
