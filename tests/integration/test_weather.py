"""Text that is not valid Unicode, and turns too large to save, on the real services (issue 10, points 4-5).

Lone surrogates (``os.listdir`` under ``surrogateescape``, a model that split a pair) enter through
input, tool results, model output and provider errors; each must be stored as U+FFFD, with the tool
or model called once. A turn of 64 large results is fitted into what one step may append (largest
first, with a visible marker) before it is saved, so every tool runs once; ``send`` refuses input
over its total cap before writing anything.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Callable
from itertools import pairwise
from typing import Any

import psycopg
import pytest

from producer.client import Client
from store import errors, payloads
from store.records import Checkpoint, Message
from tests.support import services
from tests.support.driver import Driver
from worker import Agent, ToolContext, tool
from worker.providers import MockModel, ModelResponse, ToolSpec

AGENT = "weather-text"
_SURROGATE = re.compile("[\ud800-\udfff]")
#: A file name as ``os.listdir`` returns it for the bytes ``report-\xff.txt`` (not UTF-8).
UNDECODABLE_NAME = os.fsdecode(b"report-\xff.txt")
MARKER = "[truncated"
CALLS = 64

executions: list[str] = []
model_calls: Counter[int] = Counter()


@pytest.fixture(autouse=True)
def _reset() -> None:
    executions.clear()
    model_calls.clear()


class CountingModel(MockModel):
    """``MockModel`` counting its calls per turn (a turn generated twice is a lost turn)."""

    def generate(  # type: ignore[override]  # takes no listener: this model never streams
        self, messages: list[Message], tools: list[ToolSpec]
    ) -> ModelResponse:
        model_calls[sum(1 for m in messages if m.role == "assistant")] += 1
        return super().generate(messages, tools)


@tool
def list_files(folder: str, ctx: ToolContext) -> str:
    """Names of the files in a folder."""
    executions.append(ctx.tool_call_id)
    return f"files in {folder}: notes.txt, {UNDECODABLE_NAME}"


def _size_of(index: int) -> int:
    """Result sizes from 224 KiB to just under the 256 KiB per-result cap, in a shuffled order."""
    return payloads.MAX_TOOL_RESULT - 64 - ((index * 37) % CALLS) * 512


def _big_text(index: int) -> str:
    head = f"result {index}: "
    return head + "x" * (_size_of(index) - len(head))


@tool
def big_result(index: int, ctx: ToolContext) -> str:
    """A large document."""
    executions.append(ctx.tool_call_id)
    return _big_text(index)


def _agent(script: list[Any], tools: list[Any] | None = None) -> Agent:
    return Agent(
        name=AGENT,
        model=CountingModel(script),
        instructions="Answer.",
        tools=tools or [list_files],
        max_steps=10,
        tool_concurrency=4,
    )


def _load(client: Client, session_id: str) -> Checkpoint:
    checkpoint = client.store.load(session_id)
    assert checkpoint is not None
    return checkpoint


def _surrogates_in(checkpoint: Checkpoint) -> list[str]:
    return [m.role for m in checkpoint.messages if _SURROGATE.search(payloads.dumps(m.dump()))]


def _rows(session_id: str) -> dict[str, int]:
    """How many rows of ``runs`` and ``inbox`` the run has."""
    with psycopg.connect(services.test_database_url()) as conn:
        runs = conn.execute("SELECT count(*) FROM runs WHERE session_id = %s", (session_id,)).fetchone()
        inbox = conn.execute("SELECT count(*) FROM inbox WHERE session_id = %s", (session_id,)).fetchone()
    return {"runs": runs[0] if runs else -1, "inbox": inbox[0] if inbox else -1}


# -- point 4: lone surrogates ------------------------------------------------------------------------------


def test_send_input_with_a_lone_surrogate_is_stored_with_a_replacement_character(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    driver = make_driver(_agent(["Noted."]))

    client.agent(AGENT).send(f"please read {UNDECODABLE_NAME} and \ud83d", session_id="text-input")
    driver.drain("text-input")

    checkpoint = _load(client, "text-input")
    assert checkpoint.status == "finished", checkpoint.last_error
    assert [m.content for m in checkpoint.messages if m.role == "user"] == ["please read report-\ufffd.txt and \ufffd"]
    assert _surrogates_in(checkpoint) == []


def test_a_tool_result_with_a_lone_surrogate_is_saved_once_and_the_run_finishes(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    driver = make_driver(_agent([{"tool_calls": [{"name": "list_files", "args": {"folder": "/srv"}}]}, "Two files."]))

    client.agent(AGENT).send("What is in /srv?", session_id="text-tool")
    driver.drain("text-tool")

    checkpoint = _load(client, "text-tool")
    print(f"tool executions {executions}, outcomes {[o.value for o in driver.outcomes]}")
    assert checkpoint.status == "finished" and checkpoint.final_text == "Two files.", checkpoint.last_error
    assert executions == ["call_0_0"], f"the tool ran {len(executions)} times"
    results = [m.content for m in checkpoint.messages if m.role == "tool"]
    assert results == ["files in /srv: notes.txt, report-\ufffd.txt"]
    assert _surrogates_in(checkpoint) == []


def test_model_text_with_a_lone_surrogate_is_saved_once_and_the_run_finishes(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    # A streamed emoji cut between the two halves of its surrogate pair
    driver = make_driver(
        _agent(
            [
                {"text": "Checking \ud83d", "tool_calls": [{"name": "list_files", "args": {"folder": "/tmp"}}]},
                "Sunny \ude00",
            ]
        )
    )

    client.agent(AGENT).send("Weather?", session_id="text-model")
    driver.drain("text-model")

    checkpoint = _load(client, "text-model")
    print(f"model calls per turn {dict(model_calls)}, outcomes {[o.value for o in driver.outcomes]}")
    assert checkpoint.status == "finished", checkpoint.last_error
    assert model_calls == Counter({0: 1, 1: 1}), f"turns generated again: {dict(model_calls)}"
    assert [m.content for m in checkpoint.messages if m.role == "assistant"] == ["Checking \ufffd", "Sunny \ufffd"]
    assert executions == ["call_0_0"]
    assert _surrogates_in(checkpoint) == []


def test_a_provider_error_with_a_lone_surrogate_parks_the_run_with_a_readable_error(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    driver = make_driver(_agent([{"error": f"400: unexpected file name {UNDECODABLE_NAME!s}", "retryable": False}]))

    client.agent(AGENT).send("Weather?", session_id="text-error")
    driver.drain("text-error")

    checkpoint = _load(client, "text-error")
    assert checkpoint.last_error is not None and not checkpoint.last_error.retryable, checkpoint.last_error
    assert "report-\ufffd.txt" in checkpoint.last_error.message
    assert not _SURROGATE.search(checkpoint.last_error.message)
    assert model_calls == Counter({0: 1})
    listed = {p.session_id: p for p in client.agent(AGENT).pending()}
    assert "text-error" in listed and listed["text-error"].last_error == checkpoint.last_error


# -- point 5: size ----------------------------------------------------------------------------------------


def test_a_turn_of_64_large_results_is_fitted_saved_once_and_finishes(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    calls = [{"name": "big_result", "args": {"index": k}} for k in range(CALLS)]
    driver = make_driver(_agent([{"tool_calls": calls}, "Read them all."], tools=[big_result]))

    client.agent(AGENT).send("Read every document", session_id="size-turn")
    driver.drain("size-turn")

    checkpoint = _load(client, "size-turn")
    ran = Counter(executions)
    print(
        f"tool executions {len(executions)} for {len(ran)} calls (max {max(ran.values(), default=0)} per call),"
        f" outcomes {dict(Counter(o.value for o in driver.outcomes))}, last error {checkpoint.last_error}"
    )
    assert checkpoint.status == "finished" and checkpoint.final_text == "Read them all.", checkpoint.last_error
    assert set(ran) == {f"call_0_{k}" for k in range(CALLS)} and set(ran.values()) == {1}, (
        f"tools ran again: {sorted(c for c, n in ran.items() if n > 1)}"
    )
    results = {m.tool_call_id: str(m.content) for m in checkpoint.messages if m.role == "tool"}
    assert len(results) == CALLS
    cut = {k for k in range(CALLS) if MARKER in results[f"call_0_{k}"]}
    kept = set(range(CALLS)) - cut
    assert cut, "no result was truncated, yet the turn is over the checkpoint limit"
    for k in kept:
        assert results[f"call_0_{k}"] == _big_text(k)
    for k in cut:
        assert results[f"call_0_{k}"].startswith(f"result {k}: ") and results[f"call_0_{k}"] != _big_text(k)
    # Largest first: no kept result is larger than a cut one, and a larger result never keeps less
    # text than a smaller one (the markers' lengths differ by a few characters)
    assert not kept or max(_size_of(k) for k in kept) <= min(_size_of(k) for k in cut)
    by_size = sorted(range(CALLS), key=_size_of)
    kept_chars = [results[f"call_0_{k}"].find(MARKER) if k in cut else _size_of(k) for k in by_size]
    assert all(larger >= smaller - 64 for smaller, larger in pairwise(kept_chars)), (
        f"a larger result was cut shorter than a smaller one: {kept_chars}"
    )
    size = len(payloads.dumps(checkpoint.document()).encode())
    print(f"{len(cut)} of {CALLS} results truncated, checkpoint {size} bytes (limit {payloads.MAX_CHECKPOINT})")
    assert size <= payloads.MAX_CHECKPOINT


def test_send_refuses_input_over_the_total_cap_before_writing_anything(client: Client) -> None:
    # Each message is under the 1 MiB per-string limit; together they are 18 MiB
    message = {"role": "user", "content": "y" * (900 * 1024)}
    assert len(message["content"]) < payloads.MAX_INPUT_STRING

    with pytest.raises(errors.InputTooLargeError) as raised:
        client.agent(AGENT).send([message] * 20, session_id="size-send")

    assert raised.value.code == "LOUSHO_INPUT_TOO_LARGE"
    assert _rows("size-send") == {"runs": 0, "inbox": 0}
