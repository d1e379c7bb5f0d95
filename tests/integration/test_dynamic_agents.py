"""Dynamic agents: ``resolve`` chooses model, tools and instructions per input from its metadata; the choice is saved
with the run and a later step keeps the chosen model whatever ``resolve`` would choose now; a follow-up chooses
again; a failing ``resolve`` parks the run with its input kept. Real services, steps in-process."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from producer.client import Client
from store.records import Message
from tests.support.driver import Driver
from worker import Agent, tool
from worker.dynamic import ResolveContext, RunConfig
from worker.providers import MockModel
from worker.steps import Outcome

answered_by: list[str] = []


def _model(name: str) -> MockModel:
    def answer(messages: list[Message]) -> Any:
        answered_by.append(name)
        turns = sum(1 for m in messages if m.role == "assistant")
        if turns % 2 == 0:
            return {"tool_calls": [{"name": "note", "args": {"text": name}}]}
        return f"{name} done"

    return MockModel(answer, model_id=name)


FAST, SMART = _model("fast"), _model("smart")
choice = {"tier": "fast", "fail": False}
seen: list[ResolveContext] = []


@tool
def note(text: str) -> str:
    """Write a note."""
    return f"noted {text}"


def resolve(ctx: ResolveContext) -> RunConfig:
    seen.append(ctx)
    if choice["fail"]:
        raise RuntimeError("tier service down")
    tier = (ctx.metadata or {}).get("tier", choice["tier"])
    return RunConfig(model=SMART if tier == "smart" else FAST, tools=[note], instructions=f"You are the {tier} tier.")


@pytest.fixture(autouse=True)
def _reset() -> None:
    answered_by.clear()
    seen.clear()
    choice.update(tier="fast", fail=False)


def _agent() -> Agent:
    return Agent(name="dyn", resolve=resolve, models=[FAST, SMART])


def test_the_saved_choice_outlives_what_resolve_would_choose_now(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    driver = make_driver(_agent())
    client.agent("dyn").send("hi", session_id="dyn-1", metadata={"user": "u1"})
    assert driver.step("dyn-1") == Outcome.ADVANCED  # the model turn, with the choice saved
    checkpoint = client.agent("dyn").load("dyn-1")
    assert checkpoint is not None and checkpoint.run_config is not None
    assert checkpoint.run_config["model"]["model_id"] == "fast"
    assert checkpoint.messages[0].content == "You are the fast tier." and checkpoint.metadata == {"user": "u1"}
    choice["tier"] = "smart"  # what resolve would choose from now on
    driver.drain("dyn-1")
    assert answered_by == ["fast", "fast"]
    assert client.agent("dyn").load("dyn-1").final_text == "fast done"  # type: ignore[union-attr]
    # Tools and instructions were resolved again from the saved context (its input and metadata).
    assert [c.metadata for c in seen] == [{"user": "u1"}] * len(seen) and len(seen) >= 2
    assert all([m.content for m in c.input] == ["hi"] for c in seen)


def test_a_follow_up_chooses_again_with_its_own_metadata(make_driver: Callable[..., Driver], client: Client) -> None:
    driver = make_driver(_agent())
    client.agent("dyn").send("hi", session_id="dyn-2")
    driver.drain("dyn-2")
    run = client.agent("dyn").send("again, carefully", session_id="dyn-2", metadata={"tier": "smart"})
    driver.drain("dyn-2")
    assert run.wait(timeout=5).text == "smart done"
    assert answered_by == ["fast", "fast", "smart", "smart"]
    checkpoint = client.agent("dyn").load("dyn-2")
    assert checkpoint is not None and checkpoint.run_config is not None
    assert checkpoint.run_config["model"]["model_id"] == "smart" and checkpoint.metadata == {"tier": "smart"}


def test_a_failing_resolve_parks_the_run_and_resume_starts_it(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    driver = make_driver(_agent())
    choice["fail"] = True
    run = client.agent("dyn").send("hi", session_id="dyn-3")
    driver.drain("dyn-3")
    assert driver.outcomes[-1] == Outcome.PARKED
    (pending,) = client.agent("dyn").pending()
    assert pending.last_error is not None and pending.last_error.code == "LOUSHO_CONFIG_RESOLVER_FAILED"
    assert answered_by == []
    choice["fail"] = False
    assert client.agent("dyn").resume("dyn-3") is not None
    driver.drain("dyn-3")
    assert run.wait(timeout=5).text == "fast done"


def test_a_saved_model_no_worker_can_rebuild_parks_the_run(make_driver: Callable[..., Driver], client: Client) -> None:
    driver = make_driver(_agent())
    client.agent("dyn").send("hi", session_id="dyn-4")
    driver.step("dyn-4")
    other = make_driver(Agent(name="dyn", resolve=lambda ctx: RunConfig(model=_model("other"), tools=[note])))
    other.drain("dyn-4")
    assert other.outcomes[-1] == Outcome.PARKED
    (pending,) = client.agent("dyn").pending()
    assert pending.last_error is not None and "Agent(models=" in pending.last_error.message
