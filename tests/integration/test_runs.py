"""Whole runs on the real services, stepped in-process: send-again rules, bad input, typed errors."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Connection, event

from producer.client import Client
from store import errors
from store.checkpoints import PostgresCheckpointStore
from store.leases import LeaseManager
from store.settings import Settings
from tests.support.driver import Driver, postgres
from worker import Agent, ToolContext, tool
from worker.providers import MockModel
from worker.steps import Outcome

executions: list[str] = []


@tool
def lookup(city: str, ctx: ToolContext) -> str:
    """Weather of a city."""
    executions.append(ctx.tool_call_id)
    return f"sunny in {city}"


@tool
def explode(reason: str) -> str:
    """Always fails."""
    raise RuntimeError(f"boom: {reason}")


@tool
def odd_output(kind: str) -> object:
    """Returns awkward values."""
    if kind == "nul":
        return "a\x00b"
    if kind == "nan":
        return {"value": float("nan"), "big": float("inf")}
    return "x" * (10 * 1024 * 1024)


def _three_turns() -> Agent:
    return Agent(
        name="weather",
        model=MockModel(
            [
                {
                    "tool_calls": [
                        {"name": "lookup", "args": {"city": "Oslo"}},
                        {"name": "lookup", "args": {"city": "Rome"}},
                    ]
                },
                {"tool_calls": [{"name": "lookup", "args": {"city": "Lima"}}]},
                "All sunny.",
                "Still sunny.",
                "Sunny again.",
            ]
        ),
        instructions="Report the weather.",
        tools=[lookup],
    )


@pytest.fixture(autouse=True)
def _reset() -> None:
    executions.clear()


def test_a_three_turn_run_with_parallel_calls_finishes_with_every_result_in_order(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    driver = make_driver(_three_turns())
    run = client.agent("weather").send("Weather please", session_id="w-1")
    driver.drain("w-1")
    result = run.wait(timeout=5)
    assert result.finish_reason == "stop" and result.text == "All sunny." and result.steps == 3
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
    assert [m.tool_call_id for m in result.messages if m.role == "tool"] == ["call_0_0", "call_0_1", "call_1_0"]
    assert sorted(executions) == ["call_0_0", "call_0_1", "call_1_0"]
    assert result.usage.total_tokens > 0 and len(result.tool_calls) == 3


def test_duplicate_and_late_messages_do_nothing(make_driver: Callable[..., Driver], client: Client) -> None:
    driver = make_driver(_three_turns())
    client.agent("weather").send("Weather please", session_id="w-1")
    driver.drain("w-1")
    final = client.store.load("w-1")
    assert final is not None
    # Every message of the run delivered again, stale seqs and unseq'd: nothing runs twice.
    outcomes = [driver.drain("w-1")[0] for _ in range(3)]
    driver.queue.extend(("w-1", seq) for seq in range(final.seq))
    outcomes += driver.drain()
    assert set(outcomes) <= {Outcome.IDLE, Outcome.STALE}
    assert len(executions) == 3
    assert client.store.load("w-1").seq == final.seq  # type: ignore[union-attr]


def test_a_finished_run_continues_as_a_conversation_counting_from_zero(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    driver = make_driver(_three_turns())
    agent = client.agent("weather")
    agent.send("Weather please", session_id="w-1")
    driver.drain("w-1")
    first = client.store.load("w-1")
    assert first is not None
    history = [m.dump() for m in first.messages]
    # Re-sending the stored history followed by a new message: the history is recognised.
    run = agent.send(
        [*history, {"role": "system", "content": "ignored"}, {"role": "user", "content": "And now?"}], session_id="w-1"
    )
    driver.drain("w-1")
    result = run.wait(timeout=5)
    assert result.text == "Still sunny." and result.steps == 1 and result.tool_calls == []
    assert result.usage.total_tokens < first.usage.total_tokens
    assert [m.content for m in result.messages if m.role == "user"] == ["Weather please", "And now?"]
    assert sum(1 for m in result.messages if m.role == "system") == 1


def test_input_sent_mid_run_lands_after_the_pending_results(make_driver: Callable[..., Driver], client: Client) -> None:
    driver = make_driver(_three_turns())
    agent = client.agent("weather")
    agent.send("Weather please", session_id="w-1")
    driver.queue.append(("w-1", None))
    assert driver.drain(limit=1) == [Outcome.ADVANCED]  # the model turn with two calls is saved
    driver.queue.clear()
    agent.send("Weather please", session_id="w-1")  # a retry of the starting message: not new input
    run = agent.send("Also Paris", session_id="w-1")
    driver.drain("w-1")
    result = run.wait(timeout=5)
    roles = [(m.role, m.content) for m in result.messages]
    paris = roles.index(("user", "Also Paris"))
    assert [r for r, _ in roles[paris - 2 : paris]] == ["tool", "tool"]
    assert sum(1 for r in roles if r == ("user", "Weather please")) == 1


def test_sends_from_many_threads_are_all_applied_in_commit_order(
    make_driver: Callable[..., Driver], settings: Settings, store: PostgresCheckpointStore
) -> None:
    agent_def = Agent(name="echo", model=MockModel(lambda messages: f"seen {len(messages)}"))
    driver = make_driver(agent_def)
    sends = 12
    numbers: dict[str, int] = {}
    committed: list[tuple[int, str]] = []
    lock = threading.Lock()

    # The commit order, seen from the connections: a send holds the run's row lock from its inbox
    # insert to its commit, so the next send's commit hook cannot run before this one's commit.
    def on_execute(
        conn: Connection, cursor: object, statement: str, parameters: Any, context: object, executemany: bool
    ) -> None:
        if statement.lstrip().upper().startswith("INSERT INTO INBOX"):
            [message] = json.loads(parameters["messages"])
            conn.info["inbox_entry"] = (parameters["n"], message["content"])

    def on_commit(conn: Connection) -> None:
        entry = conn.info.pop("inbox_entry", None)
        if entry is not None:
            with lock:
                committed.append(entry)

    def on_rollback(conn: Connection) -> None:
        conn.info.pop("inbox_entry", None)

    start = threading.Barrier(sends)

    def send(k: int) -> None:
        with Client(settings, engine=store.engine) as own:
            start.wait(timeout=10)
            run = own.agent("echo").send(f"message {k}", session_id="e-1")
        with lock:
            numbers[f"message {k}"] = run.input_number

    hooks: list[tuple[str, Callable[..., None]]] = [
        ("after_cursor_execute", on_execute),
        ("commit", on_commit),
        ("rollback", on_rollback),
    ]
    for name, hook in hooks:
        event.listen(store.engine, name, hook)
    try:
        threads = [threading.Thread(target=send, args=(k,)) for k in range(sends)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for name, hook in hooks:
            event.remove(store.engine, name, hook)
    commit_order = [text for _, text in committed]
    assert sorted(commit_order) == sorted(numbers) and len(commit_order) == sends
    # Inbox numbers follow commit order, and each send was told its own number.
    assert [n for n, _ in committed] == list(range(1, sends + 1))
    assert [numbers[text] for text in commit_order] == list(range(1, sends + 1))
    driver.drain("e-1")
    checkpoint = store.load("e-1")
    assert checkpoint is not None
    users = [m.content for m in checkpoint.messages if m.role == "user"]
    print(f"commit order: {[t.split()[1] for t in commit_order]}\napplied order: {[u.split()[1] for u in users]}")
    assert users == commit_order
    assert checkpoint.inbox_cursor == sends and checkpoint.status == "finished"
    assert store.inbox("e-1", 0) == []


def test_invalid_session_ids_fail_before_anything_is_written(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    make_driver(_three_turns())
    for bad in ["", "has space", ".lead", "trail.", "x" * 201, "run.turn-2", "run.paused", "run.fire", "ünï"]:
        with pytest.raises(errors.SessionIdInvalidError) as caught:
            client.agent("weather").send("hi", session_id=bad)
        assert caught.value.code == "LOUSHO_SESSION_ID_INVALID"
    assert client.store.list() == []


def test_unknown_agents_fail_at_send_time_and_as_the_runs_last_error(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    driver = make_driver(_three_turns())
    with pytest.raises(errors.AgentNotFoundError):
        client.agent("nobody").send("hi", session_id="n-1")
    assert client.store.load("n-1") is None
    # A producer that cannot know (check skipped): once LOUSHO_RETRY_FOR_S has passed with no live worker
    # serving the agent (here at once), the worker parks the run with a clear error.
    driver.deps.retry_for_s = 0.0
    run = client.agent("nobody").send("hi", session_id="n-1", check_agent=False)
    assert driver.drain("n-1") == [Outcome.PARKED]
    with pytest.raises(errors.AgentNotFoundError) as caught:
        run.wait(timeout=2)
    assert "nobody" in str(caught.value) and caught.value.retryable is False
    assert "no live worker has registered it" in str(caught.value)
    assert client.agent("nobody").pending()[0].last_error.code == "LOUSHO_AGENT_NOT_FOUND"  # type: ignore[union-attr]


def test_bad_tool_arguments_raising_tools_and_odd_outputs_become_results(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    agent_def = Agent(
        name="messy",
        model=MockModel(
            [
                {
                    "tool_calls": [
                        {"name": "lookup", "args": {"town": "Oslo"}},
                        {"name": "explode", "args": {"reason": "x"}},
                        {"name": "missing", "args": {}},
                        {"name": "odd_output", "args": {"kind": "nul"}},
                        {"name": "odd_output", "args": {"kind": "nan"}},
                        {"name": "odd_output", "args": {"kind": "big"}},
                    ]
                },
                "Done anyway.",
            ]
        ),
        tools=[lookup, explode, odd_output],
    )
    driver = make_driver(agent_def)
    run = client.agent("messy").send("go", session_id="m-1")
    driver.drain("m-1")
    result = run.wait(timeout=5)
    assert result.finish_reason == "stop"
    results = [m for m in result.messages if m.role == "tool"]
    kinds = [json.loads(m.content)["kind"] if m.is_error else None for m in results]
    assert kinds == ["validation", "execution", "not-found", None, None, None]
    assert "\x00" not in results[3].content
    assert json.loads(results[4].content) == {"value": "nan", "big": "inf"}
    assert len(results[5].content) < 300 * 1024 and "truncated" in results[5].content
    assert executions == []


def test_oversized_or_too_deep_input_is_refused(make_driver: Callable[..., Driver], client: Client) -> None:
    make_driver(_three_turns())
    agent = client.agent("weather")
    with pytest.raises(errors.InputTooLargeError):
        agent.send("x" * (1024 * 1024 + 1), session_id="big-1")
    deep: dict[str, object] = {"role": "user", "content": "x"}
    nested: dict[str, object] = {}
    cursor = nested
    for _ in range(40):
        cursor["a"] = {}
        cursor = cursor["a"]  # type: ignore[assignment]
    deep["extra"] = nested
    with pytest.raises(errors.InputTooLargeError):
        agent.send([deep], session_id="deep-1")
    run = agent.send("nul \x00 inside", session_id="nul-1")
    assert postgres(client.store).inbox("nul-1", 0)[0].messages[0].content == "nul \ufffd inside"
    assert run.input_number == 1


def test_a_failing_model_is_retried_past_the_attempts_cap_then_parked_when_the_budget_is_spent(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    flaky = Agent(name="flaky", model=MockModel([{"error": "upstream 503", "retryable": True}]))
    driver = make_driver(flaky, max_attempts=3)
    run = client.agent("flaky").send("hi", session_id="f-1")
    # Countdowns are delivered at once here: the backoff grows until the wait is the sweep's business
    outcomes = driver.drain("f-1")
    assert outcomes == [Outcome.FAILED] * len(outcomes) and len(outcomes) > 3 and driver.queue == []
    assert driver.countdowns == sorted(driver.countdowns)
    (retrying,) = client.agent("flaky").pending()
    assert retrying.state == "retrying" and retrying.next_attempt_at is not None and retrying.attempts == 0
    assert retrying.failures == len(outcomes)  # transient failures are counted apart from crash restarts
    # Once LOUSHO_RETRY_FOR_S has passed (here: set to zero), the next failure parks the run
    driver.deps.retry_for_s = 0.0
    assert driver.drain("f-1") == [Outcome.PARKED]
    with pytest.raises(errors.ProviderError) as caught:
        run.wait(timeout=2)
    assert caught.value.retryable is False and "LOUSHO_RETRY_FOR_S" in str(caught.value)
    (pending,) = client.agent("flaky").pending()
    assert pending.state == "parked" and pending.last_error is not None
    # Nothing runs a parked run until someone resumes it.
    assert driver.drain("f-1") == [Outcome.IDLE]


def test_resume_reports_nothing_pending_for_finished_and_unknown_runs(
    make_driver: Callable[..., Driver], client: Client
) -> None:
    driver = make_driver(_three_turns())
    agent = client.agent("weather")
    assert agent.resume("never-seen") is None
    agent.send("Weather please", session_id="w-1")
    driver.drain("w-1")
    assert agent.resume("w-1") is None


def test_resume_of_a_live_run_is_busy(make_driver: Callable[..., Driver], client: Client, leases: LeaseManager) -> None:
    driver = make_driver(_three_turns())
    agent = client.agent("weather")
    agent.send("Weather please", session_id="w-1")
    lease = leases.acquire("w-1")
    assert lease is not None
    with pytest.raises(errors.SessionBusyError):
        agent.resume("w-1")
    assert driver.drain("w-1") == [Outcome.BUSY]
    leases.release(lease)
    assert agent.resume("w-1") is not None


def test_sending_no_input_only_resumes(make_driver: Callable[..., Driver], client: Client) -> None:
    driver = make_driver(_three_turns())
    agent = client.agent("weather")
    with pytest.raises(errors.CheckpointNotFoundError):
        agent.send([], session_id="w-1")
    agent.send("Weather please", session_id="w-1")
    driver.drain("w-1")
    result = agent.send([], session_id="w-1").wait(timeout=2)
    assert result.text == "All sunny." and len(executions) == 3


class BilledModel(MockModel):
    """A scripted model whose usage counts as billed (kept across crashes)."""

    reports_usage = True


def test_usage_of_a_model_call_lost_to_a_crash_before_its_save_still_counts(
    make_driver: Callable[..., Driver], client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    billed = Agent(
        name="billed", model=BilledModel([{"text": "hello", "usage": {"input_tokens": 100, "output_tokens": 10}}])
    )
    driver = make_driver(billed)

    class Died(BaseException):
        pass

    def die_before_save(point: str, session_id: str) -> None:
        if point == "after_model_response_before_save":
            raise Died

    import worker.steps

    monkeypatch.setattr(worker.steps, "crash_point", die_before_save)
    run = client.agent("billed").send("hi", session_id="u-1")
    with pytest.raises(Died):
        driver.drain("u-1")
    monkeypatch.undo()
    driver.queue.clear()
    driver.drain("u-1")
    result = run.wait(timeout=5)
    # The turn was generated twice (the first answer was never saved) and both calls were billed.
    assert result.usage.input_tokens == 200 and result.usage.output_tokens == 20 and result.steps == 1
    assert client.store.load("u-1").uncounted_usage is None  # type: ignore[union-attr]
