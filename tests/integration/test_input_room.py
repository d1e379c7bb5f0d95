"""Queued input never wedges a run: ``send`` refuses input that would leave no room for a reply under the
checkpoint limit (nothing written), and a step that finds its merged input too large parks before any model
call. The way out, a fork with trimmed messages, runs. Real services, steps in-process."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import text

from producer.client import Client
from store import errors, payloads
from store.checkpoints import PostgresCheckpointStore
from store.records import Message
from tests.support.driver import Driver
from worker import Agent, tool
from worker.providers import MockModel


def big_send(letters: str) -> list[dict[str, str]]:
    """One send of three messages of the largest size one message may have (about 3 MB), one per letter."""
    return [{"role": "user", "content": letter * payloads.MAX_INPUT_STRING} for letter in letters]


asked: list[int] = []


def _counting(answers: Callable[[list[Message]], Any]) -> MockModel:
    """A scripted model that counts the calls it is paid for."""

    def answer(messages: list[Message]) -> Any:
        asked.append(len(messages))
        return answers(messages)

    return MockModel(answer)


@pytest.fixture(autouse=True)
def _reset() -> None:
    asked.clear()


def _inbox(store: PostgresCheckpointStore, session_id: str) -> tuple[int, int]:
    with store.engine.connect() as conn:
        head = conn.execute(text("SELECT inbox_head FROM runs WHERE session_id = :sid"), {"sid": session_id}).scalar()
        rows = conn.execute(text("SELECT count(*) FROM inbox WHERE session_id = :sid"), {"sid": session_id}).scalar()
    return int(head or 0), int(rows or 0)


def test_a_third_send_of_3_mb_is_refused_before_anything_is_written_and_no_model_call_is_paid(
    make_driver: Callable[..., Driver], client: Client, store: PostgresCheckpointStore
) -> None:
    driver = make_driver(Agent(name="reader", model=_counting(lambda _: "read it")))
    reader = client.agent("reader")
    for letters in ("abc", "def"):
        reader.send(big_send(letters), session_id="room-1")
        driver.drain("room-1")
    assert len(asked) == 2
    before = _inbox(store, "room-1")

    with pytest.raises(errors.InputTooLargeError) as refused:
        reader.send(big_send("ghi"), session_id="room-1")
    driver.drain("room-1")

    assert "fork" in refused.value.message and "trimmed messages" in refused.value.message
    assert refused.value.fields["session_id"] == "room-1"
    assert _inbox(store, "room-1") == before  # nothing written
    assert len(asked) == 2  # no model call for input that cannot be saved
    checkpoint = reader.load("room-1")
    assert checkpoint is not None and checkpoint.status == "finished" and checkpoint.last_error is None
    reader.send("a short question", session_id="room-1")  # input that fits is still taken
    driver.drain("room-1")
    assert len(asked) == 3


@tool
def attach(part: int) -> str:
    """Fetch one part of an attachment."""
    return f"{part}" * payloads.MAX_TOOL_RESULT


def _attaching(messages: list[Message]) -> Any:
    if sum(1 for m in messages if m.role == "assistant") == 0:
        return {"tool_calls": [{"name": "attach", "args": {"part": part}} for part in range(9)]}
    return "attached"


def test_a_step_whose_merged_input_does_not_fit_parks_before_the_model_call_and_a_trimmed_fork_goes_on(
    make_driver: Callable[..., Driver], client: Client, store: PostgresCheckpointStore
) -> None:
    driver = make_driver(Agent(name="attacher", model=_counting(_attaching), tools=[attach]))
    attacher = client.agent("attacher")
    attacher.send(big_send("abc"), session_id="room-2")
    driver.step("room-2")  # the model turn asks for the attachment: about 2 MB of results still to come
    attacher.send(big_send("def"), session_id="room-2")  # fits now; the results make it too large to merge
    driver.drain()
    assert len(asked) == 1  # the turn that asked for the attachment; the merged input never reached the model

    parked = attacher.load("room-2")
    assert parked is not None and parked.last_error is not None
    assert parked.last_error.code == errors.InputTooLargeError.code and not parked.last_error.retryable
    assert "fork" in parked.last_error.message and "model was not called" in parked.last_error.message
    assert attacher.resume("room-2") is not None  # resume tries again: parks again, still without paying
    driver.drain("room-2")
    assert len(asked) == 1
    with pytest.raises(errors.InputTooLargeError):
        attacher.send("one more thing", session_id="room-2")

    # The way out: a fork with trimmed messages.
    step = parked.step
    fork = attacher.fork(
        "room-2",
        from_step=step,
        patch={
            "messages": [
                {"role": "user", "content": "summary of the three files"},
                {"role": "assistant", "content": "summary of the attachment"},
            ],
            "append_input": "go on",
        },
    )
    attacher.resume(fork.session_id)
    driver.drain(fork.session_id)
    done = attacher.load(fork.session_id)
    assert done is not None and done.status == "finished" and done.final_text == "attached"
