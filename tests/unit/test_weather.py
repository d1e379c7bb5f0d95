"""Production weather in the step machine: failed follow-ups, partly saved batches, decisions kept
across a crash, rolling deploys (formats, tools), settings and input rules. Memory runtime, no services."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import pytest

from store import errors, payloads, records
from store.inputs import normalize_input
from store.memory import MemoryApprovalStore
from store.model_limit import LimitConflict, ModelLimit
from store.records import Message, Serving
from store.settings import load_settings
from tests.fakes.crash import Crashes, SimulatedCrash
from tests.fakes.runtime import TTL_MS, MemoryRuntime
from tests.unit.test_steps import SID, Shop, shop_agent, tool_results
from worker.agents import Agent
from worker.providers import MockModel
from worker.providers.base import ModelResponse, ToolSpec
from worker.steps import Outcome

ADVANCED, FINISHED = Outcome.ADVANCED, Outcome.FINISHED


@pytest.fixture
def shop() -> Shop:
    return Shop()


class SwitchableModel:
    """Answers like ``inner`` unless ``failure`` is set, which it raises instead."""

    def __init__(self, inner: MockModel) -> None:
        self.inner, self.model_id = inner, inner.model_id
        self.failure: errors.ProviderError | None = None
        self.calls = 0

    def generate(self, messages: list[Message], tools: list[ToolSpec]) -> ModelResponse:
        self.calls += 1
        if self.failure is not None:
            raise self.failure
        return self.inner.generate(messages, tools)


def _user_texts(runtime: MemoryRuntime) -> list[Any]:
    return [m.content for m in runtime.checkpoint(SID).messages if m.role == "user"]


# -- 1. a failed follow-up ------------------------------------------------------------------------------


def test_a_follow_up_that_fails_for_good_is_listed_parked_and_resumable(shop: Shop) -> None:
    model = SwitchableModel(MockModel(lambda messages: f"answer {sum(m.role == 'user' for m in messages)}"))
    runtime = MemoryRuntime.build([shop_agent(shop, script=[])])
    runtime.deps.agents["shop"].model = model
    runtime.send(SID, "shop", "hello")
    assert runtime.drain()[-1] == FINISHED

    # When a follow-up's model call fails non-retryably (a key rotated, say)
    model.failure = errors.ProviderError("401 invalid key", retryable=False)
    runtime.send(SID, "shop", "and then?")
    assert runtime.drain() == [Outcome.PARKED]
    # Then the run is in progress with the follow-up in its transcript, and listed with why
    parked = runtime.checkpoint(SID)
    assert parked.status == "in-progress" and _user_texts(runtime) == ["hello", "and then?"]
    (pending,) = runtime.store.pending()
    assert pending.state == "parked" and pending.last_error is not None and "401" in pending.last_error.message
    # and the sweep never sends it
    runtime.clock.advance(seconds=3600)
    assert runtime.sweep() == 0

    # When the cause is fixed, a resume finishes it, the follow-up applied once
    model.failure = None
    assert runtime.store.reset_attempts(SID) is not None
    runtime.queue(SID, None)
    assert runtime.drain()[-1] == FINISHED
    assert _user_texts(runtime) == ["hello", "and then?"] and runtime.store.pending() == []

    # And a later send to a parked run resumes it with the new input after the failed one
    model.failure = errors.ProviderError("400 context length", retryable=False)
    runtime.send(SID, "shop", "third")
    assert runtime.drain() == [Outcome.PARKED]
    model.failure = None
    runtime.send(SID, "shop", "fourth")
    assert runtime.drain()[-1] == FINISHED
    assert _user_texts(runtime) == ["hello", "and then?", "third", "fourth"]
    final = runtime.checkpoint(SID)
    assert final.last_error is None and final.messages[-1].content == "answer 4"


def test_a_follow_up_whose_steps_keep_dying_is_listed_and_left_alone_by_the_sweep(shop: Shop) -> None:
    # A follow-up that never gets as far as recording an error (its worker dies each time) is parked by
    # the crash-loop cap while the run still looks finished: it must be listed and never swept again.
    runtime = MemoryRuntime.build([shop_agent(shop, script=["one", "two"])], max_attempts=2)
    runtime.send(SID, "shop", "hello")
    assert runtime.drain()[-1] == FINISHED
    runtime.send(SID, "shop", "again")
    crashes = Crashes()
    with crashes.installed(runtime.leases):
        for _ in range(2):
            crashes.arm("during_model_call", SID)
            with pytest.raises(SimulatedCrash):
                runtime.step(SID)
            crashes.recovered()
            runtime.clock.advance(ms=TTL_MS + 1)
    assert runtime.step(SID) == Outcome.PARKED
    (pending,) = runtime.store.pending()
    assert pending.state == "parked" and pending.status == "finished"
    assert pending.last_error is not None and pending.last_error.code == "LOUSHO_STEP_ATTEMPTS_EXCEEDED"
    runtime.clock.advance(seconds=3600)
    assert runtime.sweep() == 0
    runtime.queue.messages.clear()
    assert runtime.store.reset_attempts(SID) is not None
    runtime.queue(SID, None)
    assert FINISHED in runtime.drain() and _user_texts(runtime) == ["hello", "again"]


# -- 8. smaller defects ---------------------------------------------------------------------------------


def test_the_retry_after_a_partly_saved_batch_carries_the_runs_current_seq(shop: Shop) -> None:
    runtime = MemoryRuntime.build([shop_agent(shop)])
    runtime.send(SID, "shop", "Charge and reserve")
    assert runtime.step(SID) == ADVANCED  # the model turn with two calls is saved
    runtime.queue.messages.clear()
    real_save = runtime.store.save
    saves: list[int] = []

    def second_result_save_fails(checkpoint: Any, **kwargs: Any) -> Any:
        saves.append(checkpoint.seq)
        if len(saves) == 2:
            raise errors.StorageError("database error: OperationalError")
        return real_save(checkpoint, **kwargs)

    runtime.store.save = second_result_save_fails  # type: ignore[method-assign]  # one failing save
    assert runtime.step(SID) == Outcome.FAILED
    runtime.store.save = real_save  # type: ignore[method-assign]
    # The first result was saved before the failure: the retry must be for that seq, not a stale one
    stored = runtime.checkpoint(SID)
    (retry,) = runtime.queue.messages
    assert retry.seq == stored.seq == 2
    assert runtime.drain()[-1] == FINISHED
    assert shop.runs_of("charge") == 1 and [name for name, _, _ in shop.executions].count("reserve") == 2


def test_decisions_survive_a_crash_before_the_approved_call_is_marked_started(shop: Shop) -> None:
    script: list[Any] = [
        {"tool_calls": [{"name": "refund", "args": {"amount": 5}}, {"name": "refund", "args": {"amount": 7}}]},
        "Done.",
    ]
    runtime = MemoryRuntime.build([shop_agent(shop, script=script)])
    runtime.send(SID, "shop", "Refund twice")
    assert runtime.drain() == [ADVANCED, Outcome.PAUSED]
    approvals = MemoryApprovalStore(runtime.store)
    first, second = approvals.pending()
    approvals.resolve(first.approval_id, approved=False, note="no")
    approvals.resolve(second.approval_id, approved=True)
    # The rejection result is saved first; the worker dies before the approved call is marked started
    crashes = Crashes()
    with crashes.installed(runtime.leases):
        crashes.arm("between_results", SID)
        with pytest.raises(SimulatedCrash):
            runtime.step(SID)
        crashes.recovered()
    runtime.clock.advance(ms=TTL_MS + 1)
    runtime.queue(SID, None)
    # The resumed step still knows the human's decision: it runs the call, it does not ask again
    assert runtime.drain()[-1] == FINISHED
    assert approvals.pending() == [] and shop.runs_of("refund") == 1
    assert runtime.checkpoint(SID).approval_ids == []


# -- 3. rolling deploys ---------------------------------------------------------------------------------


class FakeRegistry:
    def __init__(self, serving: list[Serving]) -> None:
        self.live = serving

    def serving(self, agent: str, within_s: float, exclude: str = "") -> list[Serving]:
        return [s for s in self.live if s.worker_id != exclude]

    def register(
        self,
        worker_id: str,
        fingerprints: Mapping[str, dict[str, Any]],
        formats: Iterable[int],
        limits: Mapping[str, ModelLimit] | None = None,
    ) -> None:
        raise AssertionError("a step never registers workers")

    def limit_conflicts(self, within_s: float) -> list[LimitConflict]:
        raise AssertionError("a step never reads limit conflicts")

    def refresh(self, worker_id: str) -> None:
        raise AssertionError("a step never refreshes workers")

    def forget(self, worker_id: str) -> None:
        raise AssertionError("a step never forgets workers")

    def live_agents(self, within_s: float) -> set[str]:
        return {"shop"} if self.live else set()

    def unregistered_for(self, agent: str, session_id: str) -> float | None:
        return None  # some worker registered every agent of these tests


def test_a_checkpoint_in_a_newer_format_is_handed_back_never_parked(shop: Shop) -> None:
    runtime = MemoryRuntime.build([shop_agent(shop)])
    runtime.send(SID, "shop", "Charge")
    document = runtime.checkpoint(SID).document()
    runtime.store.overwrite_document(
        SID, {**document, "format": records.READ_FORMATS[-1] + 1, "a_field_of_the_next_release": True}
    )
    outcomes = runtime.drain()
    assert Outcome.PARKED not in outcomes and outcomes[0] == Outcome.HANDED_BACK
    assert runtime.queue.sent[-1].countdown <= 5.0
    (pending,) = runtime.store.pending()
    assert pending.state == "retrying" and pending.last_error is not None
    assert pending.last_error.code == "LOUSHO_CHECKPOINT_FORMAT_UNKNOWN" and shop.executions == []


def test_a_call_whose_tool_only_a_newer_worker_has_is_handed_back(shop: Shop) -> None:
    script: list[Any] = [{"tool_calls": [{"name": "ship", "args": {"order": 7}}]}, "Shipped."]
    full = shop_agent(shop, script=script)
    runtime = MemoryRuntime.build([full])
    runtime.send(SID, "shop", "Ship it")
    assert runtime.step(SID) == ADVANCED  # the turn asking for ``ship`` is saved
    runtime.queue.messages.clear()
    # This worker is of the old release: its shop agent has no ``ship``
    runtime.deps.agents["shop"] = Agent("shop", full.model, tools=[t for t in full.tools.values() if t.name != "ship"])
    newer = Serving(worker_id="new:1", fingerprint=full.fingerprint(), formats=[1])
    runtime.deps.registry = FakeRegistry([newer])
    assert runtime.step(SID) == Outcome.HANDED_BACK
    assert shop.runs_of("ship") == 0 and runtime.checkpoint(SID).last_error is not None
    # With no live worker that has the tool, it is a real ResumeToolMissing: parked
    runtime.deps.registry = FakeRegistry([])
    runtime.clock.advance(seconds=10)
    assert runtime.step(SID) == Outcome.PARKED
    parked = runtime.checkpoint(SID)
    assert parked.last_error is not None and parked.last_error.code == "LOUSHO_RESUME_TOOL_MISSING"
    # The newer worker (the full agent) finishes it once the run is resumed
    runtime.deps.agents["shop"] = full
    runtime.store.reset_attempts(SID)
    runtime.queue.messages.clear()
    runtime.queue(SID, None)
    assert runtime.drain()[-1] == FINISHED and shop.runs_of("ship") == 1
    assert [m.tool_call_id for m in tool_results(runtime.checkpoint(SID))] == ["call_0_0"]


# -- settings and input ---------------------------------------------------------------------------------


def test_max_attempts_of_zero_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOUSHO_MAX_ATTEMPTS", "0")
    with pytest.raises(errors.ConfigurationError, match="LOUSHO_MAX_ATTEMPTS"):
        load_settings()


def test_a_mistyped_setting_names_the_variable_and_not_its_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOUSHO_LEASE_TTL_MS", "thirty-secret-seconds")
    with pytest.raises(errors.ConfigurationError) as caught:
        load_settings()
    assert "LOUSHO_LEASE_TTL_MS" in caught.value.message and "secret" not in caught.value.message


def test_lone_surrogates_are_replaced_wherever_text_is_cleaned() -> None:
    name = b"report-\xff.txt".decode("utf-8", "surrogateescape")
    assert payloads.clean_text(name) == "report-\ufffd.txt"
    assert payloads.clean_text("half a pair \ud83d here") == "half a pair \ufffd here"
    assert payloads.clean_text("whole pair \U0001f600") == "whole pair \U0001f600"
    assert payloads.tool_result_text({"files": [name]}) == '{"files":["report-\ufffd.txt"]}'
    (message,) = normalize_input("hi \udcff")
    assert message.content == "hi \ufffd"
    payloads.dumps(message.dump()).encode("utf-8")  # encodable


def test_a_send_over_the_total_cap_is_refused_though_each_message_is_under_its_own() -> None:
    each = "x" * 900 * 1024
    count = payloads.MAX_INPUT_TOTAL // len(each) + 1
    with pytest.raises(errors.InputTooLargeError, match="at most"):
        normalize_input([{"role": "user", "content": each}] * count)
    assert len(normalize_input([{"role": "user", "content": each}] * (count - 1))) == count - 1


def test_fit_text_keeps_within_the_byte_limit_with_a_visible_marker() -> None:
    for text in ("a" * 10_000, "é" * 10_000, "\U0001f600" * 3_000):
        fitted = payloads.fit_text(text, 1000)
        assert len(fitted.encode("utf-8")) <= 1000 and "[truncated:" in fitted
    assert payloads.fit_text("short", 1000) == "short"


def test_a_send_retried_with_its_idempotency_key_is_applied_once(shop: Shop) -> None:
    runtime = MemoryRuntime.build([shop_agent(shop)])
    first = runtime.store.append_input(SID, "shop", normalize_input("Charge"), "req-1")
    again = runtime.store.append_input(SID, "shop", normalize_input("Charge"), "req-1")
    other = runtime.store.append_input(SID, "shop", normalize_input("Charge"), "req-2")
    assert first == again == 1 and other == 2
    assert [e.n for e in runtime.store.inbox(SID, 0)] == [1, 2]
