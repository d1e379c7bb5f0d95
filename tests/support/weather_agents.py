"""Agents for the production-weather tests (issue 10): provider outages, failed follow-ups, rolling deploys.

Workers import this module through ``LOUSHO_AGENTS`` (next to ``tests.support.agents``); the test
process imports it for ``WeatherScript``, the fake provider's side of the ``weather`` agent.

``weather``
    A real ``OpenAIModel`` pointed at ``LOUSHO_WEATHER_URL`` (the fake provider server of the test
    process, or a relay in front of it that a test can take down), with one tool, ``forecast``. Its
    first user message reads ``weather <session_id> turns=N ms=M``: N-1 tool turns, then a report.
``weather-new``
    The agent a new release adds: the crash tests' logged mock model and ``work`` tool (so the
    invariant checker reads its runs). With ``LOUSHO_WEATHER_RELEASE=old`` this module is the old
    release of itself and does not define it.

Every provider call, tool execution, ``lousho.advance`` delivery and ``lousho.advance`` publish of a
process that loaded this module is appended to the JSONL file ``LOUSHO_WEATHER_LOG`` (one
``os.write`` per line, so a line survives the writer's SIGKILL). Publishes carry the name of the task
that made them (``lousho.recover`` for the sweep), which is how the tests count re-sends per run.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from store import step_message
from store.records import Message
from tests.fakes.provider_server import Api, Call, Failure, Hangup, Reply, Turn
from tests.support import agents as crash_agents
from worker import Agent, ToolContext, tool
from worker.providers import ModelResponse, ToolSpec
from worker.providers.openai import OpenAIModel

#: Base URL of the OpenAI-compatible server the ``weather`` agent calls.
URL_ENV = "LOUSHO_WEATHER_URL"
#: JSONL file of provider calls, tool executions and step deliveries and publishes.
LOG_ENV = "LOUSHO_WEATHER_LOG"
#: ``old``: this module as the release before ``weather-new`` existed.
RELEASE_ENV = "LOUSHO_WEATHER_RELEASE"
AGENT = "weather"
NEW_AGENT = "weather-new"
ADVANCE = step_message.ADVANCE
RECOVER = "lousho.recover"
#: Nothing listens on the discard port: without the variable every call fails as a connection error.
_UNSET_URL = "http://127.0.0.1:9/v1"


def log_event(record: dict[str, Any]) -> None:
    """Append one JSON line to ``LOUSHO_WEATHER_LOG`` (no-op when it is unset)."""
    crash_agents.append_event(os.environ.get(LOG_ENV), record)


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every complete line of a weather log (a line cut by a kill is skipped)."""
    try:
        with open(path, encoding="utf-8") as log:
            lines = log.read().splitlines()
    except FileNotFoundError:
        return []
    events = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


# -- the weather agent ---------------------------------------------------------------------------------


def ask(session_id: str, turns: int = 2, ms: int = 50) -> str:
    """The first user message of a ``weather`` run: ``turns`` model turns, tools sleeping ``ms``."""
    return f"weather {session_id} turns={turns} ms={ms}"


def _shape(text: str) -> tuple[str, int, int]:
    """(session id, turns, tool ms) from a first user message written by ``ask``."""
    words = text.split()
    if len(words) < 2 or words[0] != "weather":
        return "", 1, 0
    options = dict(word.partition("=")[::2] for word in words[2:])
    return words[1], int(options.get("turns", 2)), int(options.get("ms", 50))


def _first_user_text(messages: list[Message]) -> str:
    return next((str(m.content) for m in messages if m.role == "user"), "")


class LoggedOpenAIModel(OpenAIModel):
    """``OpenAIModel`` that logs every call it makes and how it ended (the count of provider calls)."""

    def generate(  # type: ignore[override]  # takes no listener: this model never streams
        self, messages: list[Message], tools: list[ToolSpec]
    ) -> ModelResponse:
        run_id = _shape(_first_user_text(messages))[0]
        turn = sum(1 for m in messages if m.role == "assistant")
        log_event({"kind": "provider", "phase": "start", "run_id": run_id, "turn_index": turn})
        try:
            response = super().generate(messages, tools)
        except Exception as exc:
            log_event(
                {
                    "kind": "provider",
                    "phase": "end",
                    "run_id": run_id,
                    "turn_index": turn,
                    "outcome": getattr(exc, "category", type(exc).__name__),
                    "retryable": getattr(exc, "retryable", None),
                }
            )
            raise
        log_event({"kind": "provider", "phase": "end", "run_id": run_id, "turn_index": turn, "outcome": "ok"})
        return response


@tool
def forecast(city: str, ms: int, ctx: ToolContext) -> str:
    """Forecast for a city (sleeps ``ms`` milliseconds, logging the execution)."""
    log_event({"kind": "tool", "run_id": ctx.session_id, "tool_call_id": ctx.tool_call_id, "phase": "start"})
    time.sleep(ms / 1000)
    return f"sunny in {city}"


weather = Agent(
    name=AGENT,
    model=LoggedOpenAIModel(
        "gpt-test", base_url=os.environ.get(URL_ENV, _UNSET_URL), api_key="sk-test-weather-0000000", timeout=5.0
    ),
    instructions="Report the weather.",
    tools=[forecast],
    max_steps=50,
)

if os.environ.get(RELEASE_ENV, "new") != "old":
    #: Only the new release has it (same model and tool as the crash tests' agents, so the checker reads it).
    weather_new = Agent(
        name=NEW_AGENT,
        model=crash_agents.chaos.model,
        instructions="Crash-test agent.",
        tools=[crash_agents.work],
        max_steps=50,
        tool_concurrency=4,
    )


# -- the fake provider's side ----------------------------------------------------------------------------

Transient = Callable[[str, int, int], Reply | None]


class WeatherScript:
    """The fake provider's answers to the ``weather`` agent (a ``FakeProviderServer.script``).

    First exchange: N-1 turns of one ``forecast`` call each, then ``report for <id>``. A follow-up
    (any later user message) gets ``reply <user messages> for <id>: <last user text>``, unless:

    - the run is in ``failing`` (a key rotation): 401, which parks the run;
    - the follow-up contains ``poison``: 400 context-length, which parks the run;
    - ``outage`` is set: 503 for everyone;
    - ``transient(run, turn, attempt)`` returns a reply (a failure) for this attempt.

    ``attempt`` counts the requests seen for the same run, turn and exchange, from 0.
    """

    def __init__(self, transient: Transient | None = None) -> None:
        self.failing: set[str] = set()
        self.outage = False
        self.transient = transient
        self.answered: Counter[str] = Counter()
        self._attempts: Counter[tuple[str, int, int]] = Counter()
        self._lock = threading.Lock()

    def __call__(self, api: Api, body: dict[str, Any]) -> Reply:
        messages = list(body.get("messages") or [])
        users = [m for m in messages if m.get("role") == "user"]
        if not users:
            return Failure(400, "no user message")
        run_id, turns, ms = _shape(str(users[0].get("content") or ""))
        assistant_turns = sum(1 for m in messages if m.get("role") == "assistant")
        last_user = max(i for i, m in enumerate(messages) if m.get("role") == "user")
        since_user = sum(1 for m in messages[last_user:] if m.get("role") == "assistant")
        with self._lock:
            attempt = self._attempts[(run_id, assistant_turns, len(users))]
            self._attempts[(run_id, assistant_turns, len(users))] += 1
        if self.outage:
            return self._count("outage", Failure(503, "The server is temporarily unavailable."))
        if self.transient is not None:
            failure = self.transient(run_id, assistant_turns, attempt)
            if failure is not None:
                return self._count("transient", failure)
        if len(users) == 1:
            if since_user < turns - 1:
                return self._count("ok", Turn(calls=(Call("forecast", {"city": f"city-{since_user}", "ms": ms}),)))
            return self._count("ok", Turn(text=f"report for {run_id}"))
        text = str(users[-1].get("content") or "")
        if run_id in self.failing:
            return self._count("refused", Failure(401, "Incorrect API key provided: sk-old...", code="invalid_api_key"))
        if "poison" in text:
            return self._count(
                "refused",
                Failure(400, "This model's maximum context length is 8192 tokens.", code="context_length_exceeded"),
            )
        return self._count("ok", Turn(text=f"reply {len(users)} for {run_id}: {text}"))

    def _count(self, what: str, reply: Reply) -> Reply:
        with self._lock:
            self.answered[what] += 1
        return reply


def flaky(rate: float, seed: int = 0) -> Transient:
    """A ``transient`` failing about ``rate`` of the attempts, decided by (run, turn, attempt) alone.

    Failures are 500, 502, 503, 429 (no Retry-After) or a hang-up, also chosen by the same hash.
    """
    kinds: tuple[Reply, ...] = (
        Failure(500, "internal error"),
        Failure(502, "bad gateway"),
        Failure(503, "overloaded"),
        Failure(429, "slow down", code="rate_limit_exceeded"),
        Hangup(),
    )

    def decide(run_id: str, turn: int, attempt: int) -> Reply | None:
        digest = hashlib.sha256(f"{seed}/{run_id}/{turn}/{attempt}".encode()).digest()
        if int.from_bytes(digest[:4], "big") / 2**32 >= rate:
            return None
        return kinds[digest[4] % len(kinds)]

    return decide


# -- step deliveries and publishes -------------------------------------------------------------------


def _install_hooks() -> None:
    """Log every ``lousho.advance`` this process starts or publishes (with the publishing task's name)."""
    from celery import current_task
    from celery.signals import after_task_publish, task_prerun

    def on_prerun(sender: Any = None, task: Any = None, args: Any = None, kwargs: Any = None, **_: Any) -> None:
        if getattr(task, "name", None) != ADVANCE:
            return
        args = list(args or ())
        request = getattr(task, "request", None)
        delivery = getattr(request, "delivery_info", None) or {}
        log_event(
            {
                "kind": "deliver",
                "run_id": args[0] if args else (kwargs or {}).get("session_id"),
                "seq": args[1] if len(args) > 1 else (kwargs or {}).get("seq"),
                "node": getattr(request, "hostname", None),
                "queue": delivery.get("routing_key"),
            }
        )

    def on_publish(sender: Any = None, body: Any = None, routing_key: Any = None, **_: Any) -> None:
        if sender != ADVANCE:
            return
        args = list(body[0]) if isinstance(body, list | tuple) and body and isinstance(body[0], list | tuple) else []
        named = body[1] if isinstance(body, list | tuple) and len(body) > 1 and isinstance(body[1], dict) else {}
        log_event(
            {
                "kind": "publish",
                "run_id": args[0] if args else named.get("session_id"),
                "seq": args[1] if len(args) > 1 else named.get("seq"),
                "by": getattr(current_task, "name", None),
                "queue": routing_key,
            }
        )

    task_prerun.connect(on_prerun, weak=False)
    after_task_publish.connect(on_publish, weak=False)


if os.environ.get(LOG_ENV):
    _install_hooks()
