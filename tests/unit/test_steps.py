"""``run_step`` end to end over the in-memory store and leases: progress, failures, fencing."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import fakeredis
import pytest

from store import errors, payloads
from store.leases import LeaseManager
from store.memory import MemoryApprovalStore, MemoryLeaseManager
from store.records import Checkpoint, Message
from tests.fakes.crash import Crashes, SimulatedCrash
from tests.fakes.model import RecordingModel
from tests.fakes.runtime import TTL_MS, MemoryRuntime
from tests.fakes.stall import WAIT_S, Gate, StepThread
from worker import machine
from worker.agents import Agent, Tool, ToolContext, tool
from worker.providers import MockModel
from worker.providers.base import ModelResponse, ToolSpec
from worker.retry import retry_delay
from worker.steps import Outcome

SID = "order-7"
ADVANCED, FINISHED = Outcome.ADVANCED, Outcome.FINISHED

THREE_TURNS: list[Any] = [
    {"tool_calls": [{"name": "charge", "args": {"amount": 5}}, {"name": "reserve", "args": {"sku": "A1"}}]},
    {"tool_calls": [{"name": "ship", "args": {"order": 7}}]},
    "Charged, reserved and shipped.",
]


class Shop:
    """The shop's tools, logging every execution with the checkpoint seq its batch started from."""

    def __init__(self) -> None:
        self.executions: list[tuple[str, str, int]] = []
        #: The approval each refund or reservation ran under (``ToolContext.approval_id``).
        self.approvals: list[tuple[str, str | None]] = []
        self.gate: Gate | None = None
        self.on_charge: Callable[[], None] | None = None

        @tool
        def charge(amount: float, ctx: ToolContext) -> str:
            """Charge the card."""
            self.executions.append(("charge", ctx.tool_call_id, ctx.checkpoint_seq))
            if self.gate is not None:
                self.gate.pass_through()
            if self.on_charge is not None:
                self.on_charge()
            return f"charged {amount}"

        @tool
        def reserve(sku: str, ctx: ToolContext) -> str:
            """Reserve stock."""
            self.executions.append(("reserve", ctx.tool_call_id, ctx.checkpoint_seq))
            self.approvals.append(("reserve", getattr(ctx, "approval_id", None)))
            return f"reserved {sku}"

        @tool
        def ship(order: int, ctx: ToolContext) -> str:
            """Ship the order."""
            self.executions.append(("ship", ctx.tool_call_id, ctx.checkpoint_seq))
            return f"shipped {order}"

        def refund(amount: float, ctx: ToolContext) -> str:
            """Refund the card."""
            self.executions.append(("refund", ctx.tool_call_id, ctx.checkpoint_seq))
            self.approvals.append(("refund", getattr(ctx, "approval_id", None)))
            return f"refunded {amount}"

        self.tools: list[Tool] = [charge, reserve, ship, Tool(refund, needs_approval=True)]

    def runs_of(self, name: str) -> int:
        return sum(1 for executed, _, _ in self.executions if executed == name)


def shop_agent(shop: Shop, script: Any = THREE_TURNS, **options: Any) -> Agent:
    settings: dict[str, Any] = {"instructions": "You run the shop.", "tool_concurrency": 1, **options}
    return Agent("shop", RecordingModel(MockModel(script)), tools=[*shop.tools, *settings.pop("tools", [])], **settings)


def model_calls(agent: Agent) -> int:
    assert isinstance(agent.model, RecordingModel)
    return len(agent.model.calls)


def tool_results(checkpoint: Checkpoint) -> list[Message]:
    return [m for m in checkpoint.messages if m.role == "tool"]


def assert_history_is_contiguous_with_rising_fences(runtime: MemoryRuntime, session_id: str = SID) -> None:
    entries = list(reversed(runtime.store.history(session_id)))
    assert [e.seq for e in entries] == list(range(1, len(entries) + 1))
    fences = [e.checkpoint.fence for e in entries]
    assert fences == sorted(fences)


@pytest.fixture
def shop() -> Shop:
    return Shop()


def _runtime_with(lease_kind: str, agent: Agent) -> tuple[MemoryRuntime, Callable[[], object]]:
    """A runtime on memory leases or on ``LeaseManager`` over fakeredis, and how to lose every lease key."""
    if lease_kind == "memory":
        runtime = MemoryRuntime.build([agent])
        assert isinstance(runtime.leases, MemoryLeaseManager)
        return runtime, runtime.leases.flush_all
    client = fakeredis.FakeRedis()
    runtime = MemoryRuntime.build([agent], leases=LeaseManager(client, TTL_MS))
    return runtime, client.flushall


# -- progress ------------------------------------------------------------------------------------


@pytest.mark.parametrize("lease_kind", ["memory", "redis-lua"])
def test_a_three_turn_run_completes_by_draining_the_queue(shop: Shop, lease_kind: str) -> None:
    # Given a shop agent scripted for three model turns
    agent = shop_agent(shop)
    runtime, _ = _runtime_with(lease_kind, agent)
    # When a send is made and every enqueued step is delivered
    runtime.send(SID, "shop", "Charge and ship order 7")
    outcomes = runtime.drain()
    # Then the run finished after three model turns and one execution per call
    assert outcomes == [ADVANCED, ADVANCED, ADVANCED, ADVANCED, FINISHED]
    final = runtime.checkpoint(SID)
    assert (final.status, final.finish_reason, final.step) == ("finished", "stop", 3)
    assert final.final_text == "Charged, reserved and shipped."
    assert machine.transcript_problems(final.messages) == []
    assert [m.tool_call_id for m in tool_results(final)] == ["call_0_0", "call_0_1", "call_1_0"]
    assert [(name, call_id) for name, call_id, _ in shop.executions] == [
        ("charge", "call_0_0"),
        ("reserve", "call_0_1"),
        ("ship", "call_1_0"),
    ]
    assert model_calls(agent) == 3
    assert final.usage.total_tokens > 0 and final.fingerprint == agent.fingerprint()
    assert_history_is_contiguous_with_rising_fences(runtime)
    assert runtime.leases.holder(SID) is None


def test_each_step_holds_a_lease_only_while_it_runs_and_enqueues_after_releasing_it(shop: Shop) -> None:
    runtime = MemoryRuntime.build([shop_agent(shop)])
    runtime.send(SID, "shop", "Charge and ship order 7")
    runtime.drain()
    assert len(runtime.heartbeat.held_ever) == 5 and runtime.heartbeat.holding == {}
    tokens = [lease.token for lease in runtime.heartbeat.held_ever]
    assert tokens == sorted(set(tokens))
    # Each step's follow-up carries the seq it saved, so a duplicate of an older message is stale.
    assert [(m.session_id, m.seq) for m in runtime.queue.sent] == [(SID, None), (SID, 1), (SID, 3), (SID, 4), (SID, 5)]


def test_tools_learn_the_checkpoint_their_batch_started_from(shop: Shop) -> None:
    runtime = MemoryRuntime.build([shop_agent(shop)])
    runtime.send(SID, "shop", "Charge and ship order 7")
    runtime.drain()
    # Both calls of the first batch started from seq 1 (the saved model turn), ship from seq 4.
    assert [seq for _, _, seq in shop.executions] == [1, 1, 4]


def test_a_finished_run_continues_as_a_new_turn_when_sent_again(shop: Shop) -> None:
    agent = shop_agent(shop, script=["Hello!", "Still here."])
    runtime = MemoryRuntime.build([agent])
    runtime.send(SID, "shop", "hi")
    runtime.drain()
    first = runtime.checkpoint(SID)
    runtime.send(SID, "shop", "hi")
    assert runtime.drain() == [FINISHED]
    second = runtime.checkpoint(SID)
    assert [m.content for m in second.messages[1:]] == ["hi", "Hello!", "hi", "Still here."]
    assert second.step == 1 and second.run_start == len(first.messages) and model_calls(agent) == 2


def test_input_sent_during_a_tool_batch_lands_after_its_results(shop: Shop) -> None:
    # Given a run whose first turn asks for charge and reserve
    runtime = MemoryRuntime.build([shop_agent(shop, script=[THREE_TURNS[0], "Done."])])
    runtime.send(SID, "shop", "Charge and reserve")

    # When a new message is sent while charge is running
    def send_more() -> None:
        runtime.send(SID, "shop", "Also gift-wrap it.")

    shop.on_charge = send_more
    runtime.drain()
    # Then the message comes after both results, and the model saw a valid transcript
    final = runtime.checkpoint(SID)
    assert [m.role for m in final.messages] == ["system", "user", "assistant", "tool", "tool", "user", "assistant"]
    assert final.messages[5].content == "Also gift-wrap it." and final.status == "finished"


def test_inputs_merged_by_one_step_start_at_the_run_start_that_merged_them(shop: Shop) -> None:
    agent = shop_agent(shop, script=["First.", "Both."])
    runtime = MemoryRuntime.build([agent])
    runtime.send(SID, "shop", "one")
    runtime.drain()
    # Given two inputs sent before the next step, when that step merges both
    runtime.send(SID, "shop", "two")
    runtime.send(SID, "shop", "three")
    runtime.drain()
    # Then one run.start names the last input it merged, and both inputs' events start there
    events = runtime.store.read_events(SID, -1)
    assert [(e.seq, e.data["input_number"]) for e in events if e.type == "run.start"] == [(0, 1), (3, 3)]
    assert [runtime.store.input_start(SID, n) for n in (1, 2, 3, 4)] == [0, 3, 3, None]
    assert model_calls(agent) == 2 and [m.content for m in runtime.checkpoint(SID).messages[-3:]] == [
        "two",
        "three",
        "Both.",
    ]


def test_a_run_that_uses_its_steps_finishes_with_max_steps(shop: Shop) -> None:
    forever = lambda messages: {"tool_calls": [{"name": "ship", "args": {"order": len(messages)}}]}  # noqa: E731
    runtime = MemoryRuntime.build([shop_agent(shop, script=forever, max_steps=2)])
    runtime.send(SID, "shop", "Ship forever")
    assert runtime.drain()[-1] == FINISHED
    final = runtime.checkpoint(SID)
    assert (final.status, final.finish_reason, final.step) == ("finished", "max-steps", 2)
    assert shop.runs_of("ship") == 2 and final.messages[-1].role == "tool"


def test_calls_past_the_per_turn_limit_get_a_not_run_result(shop: Shop) -> None:
    many = [{"name": "reserve", "args": {"sku": f"S{k}"}} for k in range(payloads.MAX_TOOL_CALLS_PER_TURN + 2)]
    runtime = MemoryRuntime.build([shop_agent(shop, script=[{"tool_calls": many}, "Done."])])
    runtime.send(SID, "shop", "Reserve everything")
    runtime.drain()
    results = tool_results(runtime.checkpoint(SID))
    assert len(results) == len(many) and shop.runs_of("reserve") == payloads.MAX_TOOL_CALLS_PER_TURN
    assert [json.loads(m.content)["kind"] for m in results[-2:]] == ["not-run", "not-run"]


# -- tool failures become results ------------------------------------------------------------------


def _error_body(checkpoint: Checkpoint, call_id: str) -> dict[str, Any]:
    (message,) = [m for m in tool_results(checkpoint) if m.tool_call_id == call_id]
    assert message.is_error
    body: dict[str, Any] = json.loads(message.content)
    return body


def test_a_raising_tool_becomes_an_execution_error_result_and_the_run_goes_on(shop: Shop) -> None:
    def explode(ctx: ToolContext) -> str:
        raise RuntimeError("card declined")

    script = [{"tool_calls": [{"name": "explode", "args": {}}]}, "Sorry, the card was declined."]
    runtime = MemoryRuntime.build([shop_agent(shop, script=script, tools=[tool(explode)])])
    runtime.send(SID, "shop", "Charge")
    assert runtime.drain()[-1] == FINISHED
    body = _error_body(runtime.checkpoint(SID), "call_0_0")
    assert (body["kind"], body["error"], body["message"]) == ("execution", "RuntimeError", "card declined")


def test_invalid_arguments_become_a_validation_error_result_and_the_tool_does_not_run(shop: Shop) -> None:
    script = [{"tool_calls": [{"name": "charge", "args": {"amount": "a lot"}}]}, "Could not charge."]
    runtime = MemoryRuntime.build([shop_agent(shop, script=script)])
    runtime.send(SID, "shop", "Charge")
    assert runtime.drain()[-1] == FINISHED
    body = _error_body(runtime.checkpoint(SID), "call_0_0")
    assert (body["kind"], body["error"]) == ("validation", "ToolArgsInvalid") and "amount" in body["message"]
    assert shop.runs_of("charge") == 0


def test_a_call_to_a_tool_the_agent_lacks_gets_a_not_found_result(shop: Shop) -> None:
    script = [{"tool_calls": [{"name": "teleport", "args": {}}]}, "Cannot."]
    runtime = MemoryRuntime.build([shop_agent(shop, script=script)])
    runtime.send(SID, "shop", "Teleport")
    runtime.drain()
    assert _error_body(runtime.checkpoint(SID), "call_0_0")["kind"] == "not-found"


@pytest.mark.parametrize(
    ("returned", "check"),
    [
        ("a\x00b", lambda text: text == "a\ufffdb"),
        ({"ratio": math.nan, "big": math.inf}, lambda text: json.loads(text) == {"ratio": "nan", "big": "inf"}),
        ("x" * 10_000_000, lambda text: len(text) < 300_000 and "[truncated: " in text),
        (10**5000, lambda text: "integer of" in text),
    ],
    ids=["nul", "nan-inf", "ten-megabytes", "huge-int"],
)
def test_odd_tool_output_is_stored_sanitized_and_the_tool_runs_once(
    shop: Shop, returned: Any, check: Callable[[str], bool]
) -> None:
    runs: list[int] = []

    def odd(ctx: ToolContext) -> Any:
        runs.append(1)
        return returned

    script = [{"tool_calls": [{"name": "odd", "args": {}}]}, "Done."]
    runtime = MemoryRuntime.build([shop_agent(shop, script=script, tools=[tool(odd)])])
    runtime.send(SID, "shop", "Do the odd thing")
    assert runtime.drain()[-1] == FINISHED
    (result,) = tool_results(runtime.checkpoint(SID))
    assert check(result.content) and len(runs) == 1


@pytest.mark.parametrize(
    "args", [{"note": "a\x00b"}, {"ratio": math.nan}, {"n": 10**5000}], ids=["nul", "nan", "huge-int"]
)
def test_odd_arguments_from_the_model_do_not_poison_the_run(shop: Shop, args: dict[str, Any]) -> None:
    # A provider can hand back argument JSON with \u0000, NaN or huge numbers; the turn must still save.
    def note(ctx: ToolContext, **anything: Any) -> str:
        return "noted"

    script = [{"tool_calls": [{"name": "charge", "args": args}]}, "Done."]
    runtime = MemoryRuntime.build([shop_agent(shop, script=script, tools=[tool(note)])])
    runtime.send(SID, "shop", "Go")
    assert runtime.drain()[-1] == FINISHED
    final = runtime.checkpoint(SID)
    assert final.last_error is None and len(tool_results(final)) == 1


# -- failed steps, retries and parking ---------------------------------------------------------------


class FlakyModel:
    """Raises the queued errors first, then answers like ``inner``."""

    def __init__(self, inner: MockModel, failures: list[errors.ProviderError]) -> None:
        self.inner, self.failures, self.model_id = inner, failures, inner.model_id
        self.calls = 0

    def generate(self, messages: list[Message], tools: list[ToolSpec]) -> ModelResponse:
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        return self.inner.generate(messages, tools)


def _flaky_runtime(
    shop: Shop, failures: list[errors.ProviderError], **options: Any
) -> tuple[MemoryRuntime, FlakyModel]:
    model = FlakyModel(MockModel(["Hello!"]), failures)
    runtime = MemoryRuntime.build([Agent("shop", model, tools=shop.tools)], **options)
    runtime.send(SID, "shop", "hi")
    return runtime, model


def test_a_provider_error_is_recorded_and_the_same_seq_is_retried_after_a_countdown(shop: Shop) -> None:
    runtime, _ = _flaky_runtime(shop, [errors.ProviderError("503 upstream", retryable=True)])
    assert runtime.step(SID) == Outcome.FAILED
    failed = runtime.checkpoint(SID)
    assert failed.last_error is not None
    # A failure the step recorded is not a crash: the crash-loop count restarts, the failure streak grows
    assert (failed.last_error.code, failed.last_error.retryable, failed.attempts, failed.failures) == (
        "LOUSHO_PROVIDER_REQUEST_FAILED",
        True,
        0,
        1,
    )
    (retry,) = runtime.queue.messages[1:]
    # The merged input was saved before the failure was recorded: the retry is for that state
    assert retry.seq == failed.seq == 1 and 0.25 <= retry.countdown <= 0.5 and retry.agent == "shop"
    assert failed.next_attempt_at is not None
    # When the retry is delivered and the provider answers, the error and the attempts are cleared
    runtime.queue.pop()
    assert runtime.drain() == [FINISHED]
    done = runtime.checkpoint(SID)
    assert (done.status, done.last_error, done.attempts) == ("finished", None, 0)


def test_a_provider_error_message_with_a_nul_is_still_recorded(shop: Shop) -> None:
    # An error can quote the provider's response body; Postgres would refuse a NUL in last_error.
    runtime, _ = _flaky_runtime(shop, [errors.ProviderError("bad gateway\x00<html>", retryable=True)])
    assert runtime.step(SID) == Outcome.FAILED
    failed = runtime.checkpoint(SID)
    assert failed.last_error is not None and failed.last_error.message == "bad gateway\ufffd<html>"


def test_a_provider_retry_after_is_honoured_in_full_by_the_sweep_not_a_long_countdown(shop: Shop) -> None:
    runtime, model = _flaky_runtime(shop, [errors.ProviderError("429", retryable=True, retry_after=120.0)])
    runtime.queue.pop()
    assert runtime.step(SID) == Outcome.FAILED
    failed = runtime.checkpoint(SID)
    assert failed.next_attempt_at is not None
    wait = (failed.next_attempt_at - runtime.clock()).total_seconds()
    assert 120.0 <= wait <= 120.0 + runtime.deps.retry_backoff_max_s / 10  # above the backoff cap of 30 s
    assert list(runtime.queue.messages) == []  # no Celery countdown past a few seconds (RELIABILITY P1)
    # The sweep leaves it alone until its time comes, then sends it once
    runtime.clock.advance(seconds=119)
    assert runtime.sweep() == 0
    runtime.clock.advance(seconds=wait - 119 + 0.001)
    assert runtime.sweep() == 1 and runtime.drain() == [FINISHED] and model.calls == 2


def test_pending_shows_the_failure_streak_and_the_next_attempt_apart_from_crash_restarts(shop: Shop) -> None:
    # Given a run whose model call failed transiently twice in a row (no crash)
    runtime, _ = _flaky_runtime(shop, [errors.ProviderError("503", retryable=True) for _ in range(2)])
    runtime.queue.pop()
    assert runtime.step(SID) == Outcome.FAILED
    runtime.clock.advance(seconds=runtime.deps.retry_backoff_max_s + 1)
    assert runtime.step(SID) == Outcome.FAILED
    # When it is listed, then it shows two failures in a row, when it is tried next, and no crash restart
    (listed,) = runtime.store.pending()
    stored = runtime.checkpoint(SID)
    assert (listed.state, listed.failures, listed.attempts) == ("retrying", 2, 0)
    assert listed.next_attempt_at == stored.next_attempt_at is not None
    # And once a step succeeds, the streak is gone
    runtime.clock.advance(seconds=runtime.deps.retry_backoff_max_s + 1)
    assert runtime.step(SID) == FINISHED
    assert runtime.checkpoint(SID).failures == 0 and runtime.checkpoint(SID).next_attempt_at is None


def test_backoff_grows_with_each_failure_in_a_row_up_to_the_cap() -> None:
    for failures, low, high in [(1, 0.25, 0.5), (2, 0.5, 1.0), (3, 1.0, 2.0), (6, 8.0, 16.0), (20, 15.0, 30.0)]:
        delays = [retry_delay(failures, None, 30.0) for _ in range(200)]
        assert all(low <= d <= high for d in delays), (failures, min(delays), max(delays))
    assert min(retry_delay(3, None, 30.0) for _ in range(50)) > max(retry_delay(1, None, 30.0) for _ in range(50))


def test_transient_failures_are_retried_for_the_retry_budget_not_the_attempts_cap(shop: Shop) -> None:
    failures = [errors.ProviderError("503", retryable=True) for _ in range(40)]
    runtime, model = _flaky_runtime(shop, failures, max_attempts=5)
    runtime.deps.retry_for_s = 120.0
    outcomes: list[Outcome] = []
    for _ in range(100):
        outcomes += runtime.drain()
        if outcomes[-1] == Outcome.PARKED:
            break
        runtime.clock.advance(seconds=31)
        runtime.sweep()
    # Far more failures than the attempts cap of 5 were retried; the budget of 120 s parked the run
    assert outcomes[-1] == Outcome.PARKED and outcomes.count(Outcome.FAILED) > 5 and model.calls > 5
    parked = runtime.checkpoint(SID)
    assert parked.last_error is not None and parked.last_error.retryable is False
    assert "LOUSHO_RETRY_FOR_S is 120" in parked.last_error.message
    runtime.clock.advance(seconds=3600)
    assert runtime.store.stale_runs(1.0) == []
    # A later duplicate does nothing to a parked run
    calls = model.calls
    assert runtime.step(SID) == Outcome.IDLE and model.calls == calls


def test_a_non_retryable_provider_error_parks_the_run_at_once(shop: Shop) -> None:
    runtime, model = _flaky_runtime(shop, [errors.ProviderError("400 bad request", retryable=False)])
    assert runtime.drain() == [Outcome.PARKED]
    parked = runtime.checkpoint(SID)
    assert parked.last_error is not None and parked.last_error.retryable is False and model.calls == 1


def test_a_run_whose_agent_no_worker_serves_is_handed_back_then_parked_after_the_budget(shop: Shop) -> None:
    runtime = MemoryRuntime.build([shop_agent(shop)])
    runtime.deps.retry_for_s = 60.0
    runtime.send(SID, "warehouse", "Count the boxes")
    outcomes = runtime.drain()
    # Handed back with backoff, and with no message to a queue nobody consumes: the sweep sends it when due
    assert outcomes == [Outcome.HANDED_BACK] and runtime.queue.messages == []
    waiting = runtime.checkpoint(SID)
    assert waiting.last_error is not None and waiting.last_error.retryable is True
    for _ in range(50):
        runtime.clock.advance(seconds=31)
        runtime.sweep()
        outcomes += runtime.drain()
        if outcomes[-1] == Outcome.PARKED:
            break
    parked = runtime.checkpoint(SID)
    assert parked.last_error is not None
    assert (parked.last_error.code, parked.last_error.retryable) == ("LOUSHO_AGENT_NOT_FOUND", False)
    assert "no live worker has registered it" in parked.last_error.message
    assert parked.messages == [] and shop.executions == []


def test_steps_that_keep_dying_park_the_run_once_the_attempts_run_out(shop: Shop) -> None:
    # Given a run whose every step dies during the model call (no error can be recorded)
    agent = shop_agent(shop)
    runtime = MemoryRuntime.build([agent], max_attempts=5)
    runtime.send(SID, "shop", "Charge")
    crashes = Crashes()
    with crashes.installed(runtime.leases):
        for _ in range(5):
            crashes.arm("during_model_call", SID)
            with pytest.raises(SimulatedCrash):
                runtime.step(SID)
            crashes.recovered()
            # The dead worker's lease is still there until it expires
            assert runtime.step(SID) == Outcome.BUSY
            runtime.clock.advance(ms=TTL_MS + 1)
        # When it is delivered once more, then it is parked instead of being tried again
        assert runtime.step(SID) == Outcome.PARKED
    parked = runtime.checkpoint(SID)
    assert parked.last_error is not None and parked.last_error.code == "LOUSHO_STEP_ATTEMPTS_EXCEEDED"
    assert model_calls(agent) == 0


def test_a_corrupt_checkpoint_parks_the_run(shop: Shop) -> None:
    runtime = MemoryRuntime.build([shop_agent(shop)])
    runtime.send(SID, "shop", "Charge")
    runtime.step(SID)
    runtime.store.overwrite_document(SID, {"messages": "not a list"})
    assert runtime.step(SID) == Outcome.PARKED
    (entry,) = runtime.store.list()
    assert entry.last_error is not None and entry.last_error.code == "LOUSHO_CHECKPOINT_CORRUPT"


# -- duplicates, busy runs and fencing -------------------------------------------------------------------


def test_a_message_with_a_stale_seq_is_dropped_without_work(shop: Shop) -> None:
    agent = shop_agent(shop)
    runtime = MemoryRuntime.build([agent])
    runtime.send(SID, "shop", "Charge")
    runtime.step(SID)
    before = runtime.checkpoint(SID)
    assert runtime.step(SID, seq=0) == Outcome.STALE
    after = runtime.checkpoint(SID)
    assert (after.seq, after.attempts, after.messages) == (before.seq, before.attempts, before.messages)
    assert model_calls(agent) == 1 and shop.executions == [] and len(runtime.queue) == 2


def test_a_message_for_a_run_that_is_busy_elsewhere_is_dropped(shop: Shop) -> None:
    runtime = MemoryRuntime.build([shop_agent(shop)])
    runtime.send(SID, "shop", "Charge")
    elsewhere = runtime.leases.acquire(SID)
    assert elsewhere is not None
    before = runtime.checkpoint(SID)
    assert runtime.step(SID) == Outcome.BUSY
    after = runtime.checkpoint(SID)
    assert (after.fence, after.attempts, after.seq) == (before.fence, before.attempts, before.seq)
    assert runtime.leases.holder(SID) == elsewhere.owner and len(runtime.queue) == 1


def test_an_unknown_run_is_reported_and_an_invalid_id_touches_nothing(shop: Shop) -> None:
    runtime = MemoryRuntime.build([shop_agent(shop)])
    assert runtime.step("never-sent") == Outcome.UNKNOWN
    assert runtime.leases.holder("never-sent") is None
    with pytest.raises(errors.SessionIdInvalidError):
        runtime.step("'; DROP TABLE runs; --")


def _started_batch(shop: Shop, blocking: int = 1) -> tuple[MemoryRuntime, Agent, Gate]:
    """A run whose model turn (charge, reserve) is saved, with charge blocking ``blocking`` times."""
    agent = shop_agent(shop)
    runtime = MemoryRuntime.build([agent])
    runtime.send(SID, "shop", "Charge and ship order 7")
    assert runtime.step(SID) == ADVANCED
    runtime.queue.messages.clear()
    shop.gate = Gate(blocking)
    return runtime, agent, shop.gate


@pytest.fixture
def stalled_threads() -> Iterator[list[Gate]]:
    gates: list[Gate] = []
    yield gates
    for gate in gates:
        gate.release_all()


def test_a_stalled_holder_is_fenced_after_a_takeover_and_leaves_no_trace(
    shop: Shop, stalled_threads: list[Gate]
) -> None:
    # Given a step frozen inside a tool call
    runtime, _, gate = _started_batch(shop)
    stalled_threads.append(gate)
    stalled = StepThread(lambda: runtime.step(SID, 1))
    stalled.start()
    assert gate.wait_entered()
    # When its lease expires and another worker takes the run over and runs the batch
    runtime.clock.advance(ms=TTL_MS + 1)
    assert runtime.step(SID, 1) == ADVANCED
    after_takeover, history = runtime.checkpoint(SID), runtime.store.history(SID)
    # When the frozen step wakes up
    gate.release()
    # Then its save is refused, and nothing it did is stored or enqueued
    assert stalled.result() == Outcome.FENCED
    assert runtime.checkpoint(SID) == after_takeover and runtime.store.history(SID) == history
    assert [m.seq for m in runtime.queue.messages] == [after_takeover.seq]
    assert shop.runs_of("charge") == 2 and shop.runs_of("reserve") == 1  # at least once, never lost
    assert [m.tool_call_id for m in tool_results(after_takeover)] == ["call_0_0", "call_0_1"]
    assert_history_is_contiguous_with_rising_fences(runtime)


def test_a_stalled_holder_is_fenced_even_before_the_new_holder_saves(shop: Shop, stalled_threads: list[Gate]) -> None:
    # Given a frozen step, and a second step that took over and is itself inside the same tool
    runtime, _, gate = _started_batch(shop, blocking=2)
    stalled_threads.append(gate)
    first = StepThread(lambda: runtime.step(SID, 1))
    first.start()
    assert gate.wait_entered(0)
    runtime.clock.advance(ms=TTL_MS + 1)
    second = StepThread(lambda: runtime.step(SID, 1))
    second.start()
    assert gate.wait_entered(1)
    # When the first one wakes up before the second one saved anything
    gate.release(0)
    # Then it is refused already: the second one's claim moved the fence
    assert first.result() == Outcome.FENCED
    assert runtime.checkpoint(SID).seq == 1
    gate.release(1)
    assert second.result() == ADVANCED
    assert runtime.drain()[-1] == FINISHED
    assert_history_is_contiguous_with_rising_fences(runtime)


def test_a_stalled_model_call_is_not_saved_after_a_takeover(stalled_threads: list[Gate]) -> None:
    gate = Gate()
    stalled_threads.append(gate)

    def answer(messages: list[Message]) -> str:
        gate.pass_through()
        return "Hello!"

    agent = Agent("shop", RecordingModel(MockModel(answer)))
    runtime = MemoryRuntime.build([agent])
    runtime.send(SID, "shop", "hi")
    stalled = StepThread(lambda: runtime.step(SID))
    stalled.start()
    assert gate.wait_entered()
    runtime.clock.advance(ms=TTL_MS + 1)
    assert runtime.step(SID) == FINISHED
    gate.release()
    assert stalled.result() == Outcome.FENCED
    final = runtime.checkpoint(SID)
    assert [m.role for m in final.messages] == ["user", "assistant"] and final.seq == 1
    assert model_calls(agent) == 2  # one wasted call, never a second saved turn


def test_a_batch_starts_no_call_once_its_lease_is_known_lost(shop: Shop) -> None:
    runtime, _, _ = _started_batch(shop, blocking=0)
    leases = runtime.leases
    assert isinstance(leases, MemoryLeaseManager)

    def lose_the_lease() -> None:
        # While charge runs, the lease expires, another worker takes it, and a renewal finds out.
        (lease,) = runtime.heartbeat.holding.values()
        leases.expire(SID)
        assert leases.acquire(SID) is not None
        assert leases.renew(lease) is False

    shop.on_charge = lose_the_lease
    assert runtime.step(SID, 1) == Outcome.FENCED
    assert shop.runs_of("charge") == 1 and shop.runs_of("reserve") == 0
    shop.on_charge = None
    leases.expire(SID)
    runtime.queue(SID, None)
    assert runtime.drain()[-1] == FINISHED
    assert shop.runs_of("reserve") == 1


@pytest.mark.parametrize("lease_kind", ["memory", "redis-lua"])
def test_after_the_lease_service_loses_its_counters_the_run_goes_on_above_the_stored_fence(
    shop: Shop, lease_kind: str
) -> None:
    # Given a run two steps in, whose stored fence is the token of the last step
    runtime, lose_everything = _runtime_with(lease_kind, shop_agent(shop))
    runtime.send(SID, "shop", "Charge and ship order 7")
    runtime.queue.pop()
    runtime.step(SID)
    runtime.step(SID, 1)
    fence_before = runtime.checkpoint(SID).fence
    # When every lease key and counter is lost, and the run is delivered again
    lose_everything()
    # Then the next step mints a token above the stored fence instead of being blocked
    assert runtime.drain()[-1] == FINISHED
    assert runtime.heartbeat.held_ever[2].token > fence_before
    assert_history_is_contiguous_with_rising_fences(runtime)


def test_after_the_lease_service_loses_its_counters_a_stalled_holder_is_still_fenced(
    shop: Shop, stalled_threads: list[Gate]
) -> None:
    runtime, _, gate = _started_batch(shop)
    stalled_threads.append(gate)
    leases = runtime.leases
    assert isinstance(leases, MemoryLeaseManager)
    stalled = StepThread(lambda: runtime.step(SID, 1))
    stalled.start()
    assert gate.wait_entered()
    stalled_fence = runtime.checkpoint(SID).fence
    leases.flush_all()
    assert runtime.step(SID, 1) == ADVANCED
    assert runtime.checkpoint(SID).fence > stalled_fence
    gate.release()
    assert stalled.result() == Outcome.FENCED
    assert_history_is_contiguous_with_rising_fences(runtime)


# -- out-of-order results ----------------------------------------------------------------------------


def test_results_settling_out_of_order_are_each_saved_at_once_in_call_order() -> None:
    # Given a turn of two calls run concurrently, where the first one waits for the second's save
    second_saved = threading.Event()
    saves: list[list[str | None]] = []

    @tool
    def slow(ctx: ToolContext) -> str:
        """Finishes last."""
        assert second_saved.wait(WAIT_S)
        return "slow"

    @tool
    def fast(ctx: ToolContext) -> str:
        """Finishes first."""
        return "fast"

    script = [{"tool_calls": [{"name": "slow", "args": {}}, {"name": "fast", "args": {}}]}, "Done."]
    runtime = MemoryRuntime.build([Agent("shop", MockModel(script), tools=[slow, fast], tool_concurrency=2)])
    original_save = runtime.store.save

    def observed_save(checkpoint: Checkpoint, **kwargs: Any) -> Any:
        saved = original_save(checkpoint, **kwargs)
        saves.append([m.tool_call_id for m in checkpoint.messages if m.role == "tool"])
        if saves[-1] == ["call_0_1"]:
            second_saved.set()
        return saved

    runtime.store.save = observed_save  # type: ignore[method-assign]  # observe the saves of this run
    runtime.send(SID, "shop", "Go")
    assert runtime.drain()[-1] == FINISHED
    # Then the fast result was saved alone first, and the slow one was put before it
    assert saves[1:3] == [["call_0_1"], ["call_0_0", "call_0_1"]]
    assert machine.transcript_problems(runtime.checkpoint(SID).messages) == []


# -- approvals ---------------------------------------------------------------------------------------------

REFUND_TURN: list[Any] = [
    {"tool_calls": [{"name": "refund", "args": {"amount": 5}}, {"name": "reserve", "args": {"sku": "A1"}}]},
    "Refunded.",
]


def _paused_on_refund(shop: Shop) -> tuple[MemoryRuntime, MemoryApprovalStore, str]:
    runtime = MemoryRuntime.build([shop_agent(shop, script=REFUND_TURN)])
    runtime.send(SID, "shop", "Refund order 7")
    assert runtime.drain() == [ADVANCED, Outcome.PAUSED]
    approvals = MemoryApprovalStore(runtime.store)
    (pending,) = approvals.pending()
    return runtime, approvals, pending.approval_id


def test_a_gated_call_pauses_the_run_and_an_approval_runs_it_once(shop: Shop) -> None:
    # Given a run paused on the refund while the ungated call already ran
    runtime, approvals, approval_id = _paused_on_refund(shop)
    paused = runtime.checkpoint(SID)
    assert paused.status == "awaiting-approval" and paused.approval_ids == [approval_id]
    assert shop.runs_of("reserve") == 1 and shop.runs_of("refund") == 0
    with pytest.raises(errors.SessionAwaitingApprovalError):
        runtime.send(SID, "shop", "Are you done?")
    # When a human approves it and the run is advanced
    assert approvals.resolve(approval_id, approved=True).run_continues
    runtime.queue(SID, None)
    assert runtime.drain()[-1] == FINISHED
    # Then the refund ran once, its result sits in call order, and the model finished
    final = runtime.checkpoint(SID)
    assert shop.runs_of("refund") == 1
    assert [m.tool_call_id for m in tool_results(final)] == ["call_0_0", "call_0_1"]
    assert final.started_tool_call_ids == [] and final.approval_ids == []


def test_an_approved_call_is_told_the_approval_it_runs_under(shop: Shop) -> None:
    # Given a run paused on the refund, the reservation of the same turn already run without an approval
    runtime, approvals, approval_id = _paused_on_refund(shop)
    # When a person approves the refund and the run goes on
    approvals.resolve(approval_id, approved=True)
    runtime.queue(SID, None)
    assert runtime.drain()[-1] == FINISHED
    # Then the refund ran with the id of the decision that let it run (to tie its effect to), the reservation with none
    assert shop.approvals == [("reserve", None), ("refund", approval_id)]


def test_a_rejected_call_gets_a_rejection_result_and_never_runs(shop: Shop) -> None:
    runtime, approvals, approval_id = _paused_on_refund(shop)
    approvals.resolve(approval_id, approved=False, note="not this month")
    runtime.queue(SID, None)
    assert runtime.drain()[-1] == FINISHED
    body = _error_body(runtime.checkpoint(SID), "call_0_0")
    assert (body["kind"], body["note"]) == ("rejected", "not this month") and shop.runs_of("refund") == 0


@pytest.mark.parametrize(
    ("point", "refund_runs"),
    [
        ("after_started_marker_before_approved_call", 0),
        ("after_approved_effect_before_result_save", 1),
    ],
)
def test_an_approved_call_interrupted_by_a_crash_is_not_run_again(shop: Shop, point: str, refund_runs: int) -> None:
    runtime, approvals, approval_id = _paused_on_refund(shop)
    approvals.resolve(approval_id, approved=True)
    crashes = Crashes()
    with crashes.installed(runtime.leases):
        crashes.arm(point, SID)
        with pytest.raises(SimulatedCrash):
            runtime.step(SID)
        crashes.recovered()
    runtime.clock.advance(ms=TTL_MS + 1)
    runtime.queue(SID, None)
    assert runtime.drain()[-1] == FINISHED
    body = _error_body(runtime.checkpoint(SID), "call_0_0")
    assert body["kind"] == "interrupted" and shop.runs_of("refund") == refund_runs
