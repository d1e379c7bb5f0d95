"""A step under a ``ModelLimit``: it waits without failing and without holding anything, a freed slot wakes the next
waiter, a 429 with ``Retry-After`` cools the whole key down, and the fairness key sent with input reaches the run."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import SecretStr

from producer.http.config import WebhookConfig
from store import errors
from store.inputs import normalize_input
from store.memory import MemoryModelSlots
from store.model_limit import ModelLimit
from store.settings import Settings
from tests.fakes.runtime import MemoryRuntime
from worker import slots
from worker.agents import Agent
from worker.providers.mock import MockModel
from worker.steps import Outcome

ONE = ModelLimit("acct", concurrent=1)


def _runtime(*agents: Agent) -> tuple[MemoryRuntime, MemoryModelSlots]:
    runtime = MemoryRuntime.build(agents)
    model_slots = MemoryModelSlots(2000, runtime.clock)
    runtime.deps.slots = model_slots
    return runtime, model_slots


def test_a_step_without_a_free_slot_waits_without_failing_and_a_freed_slot_wakes_it() -> None:
    # Given another process holds the one slot of the key
    runtime, model_slots = _runtime(Agent("limited", MockModel(["done"]), model_limit=ONE))
    assert model_slots.acquire(ONE, "elsewhere", "limited").granted
    runtime.send("r-1", "limited", "hi")
    # When the run's step comes
    assert runtime.drain() == [Outcome.WAITING]
    # Then it waits: no failure, no attempt counted, no message (its wake-up brings it back), the sweep told so
    stored = runtime.checkpoint("r-1")
    assert stored.last_error is None and stored.attempts == 0 and stored.status == "in-progress"
    assert len(runtime.queue) == 0
    assert model_slots.waiting(["r-1"]) == {"r-1": ("acct", "slot")}
    # When the holder gives its slot back, the waiter is named; its step finishes the run
    woken = model_slots.release(ONE, "elsewhere")
    assert woken == (("r-1", "limited"),)
    runtime.queue("r-1", None)
    assert runtime.drain() == [Outcome.FINISHED]
    assert runtime.checkpoint("r-1").final_text == "done"
    assert model_slots.waiting(["r-1"]) == {}
    assert [(u.in_use, u.waiting) for u in model_slots.usage()] == [(0, 0)]


def test_the_step_that_frees_a_slot_sends_the_next_waiter_its_step() -> None:
    runtime: MemoryRuntime
    inner: list[Outcome] = []

    def answer(messages: list[Any]) -> Any:
        if not inner:
            # While r-1's call holds the one slot, r-2's step comes (another process, in a real fleet)
            inner.append(runtime.step("r-2"))
        return "done"

    runtime, _ = _runtime(Agent("limited", MockModel(answer), model_limit=ONE))
    runtime.store.append_input("r-1", "limited", normalize_input("hi"))
    runtime.store.append_input("r-2", "limited", normalize_input("hi"))
    # When r-1's step runs its model call and gives the slot back
    assert runtime.step("r-1") == Outcome.FINISHED
    # Then r-2 had waited, and r-1's step sent r-2 its step to its agent's queue
    assert inner == [Outcome.WAITING]
    (woken,) = runtime.queue.messages
    assert (woken.session_id, woken.agent, woken.name) == ("r-2", "limited", "limited: model slot freed")
    assert runtime.drain() == [Outcome.FINISHED]


def test_a_429_with_retry_after_cools_the_key_down_for_every_caller_and_is_no_failure() -> None:
    calls: list[int] = []

    def answer(messages: list[Any]) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise errors.ProviderRateLimitedError("slow down", retry_after=2.0)
        return "done"

    runtime, model_slots = _runtime(Agent("limited", MockModel(answer), model_limit=ModelLimit("acct", concurrent=4)))
    runtime.store.append_input("r-1", "limited", normalize_input("hi"))
    # When the provider answers 429 with Retry-After: 2
    assert runtime.step("r-1") == Outcome.WAITING
    # Then the run waits (no failure recorded, its step comes back by a short countdown) and the key cools down
    stored = runtime.checkpoint("r-1")
    assert stored.last_error is None and stored.attempts == 0
    (back,) = runtime.queue.messages
    assert back.session_id == "r-1" and back.countdown == pytest.approx(2.0, abs=0.3)
    other = model_slots.acquire(ModelLimit("acct", concurrent=4), "r-other", "limited")
    assert not other.granted and other.reason == "cool-down" and 1.5 < other.wait_s <= 2.0
    # ... and once the cool-down is over the call goes through
    runtime.queue.messages.clear()
    assert runtime.step("r-1") == Outcome.WAITING  # still cooling: no provider call made
    assert len(calls) == 1
    runtime.clock.advance(2.1)
    assert runtime.step("r-1") == Outcome.FINISHED
    assert len(calls) == 2


def test_agents_giving_one_key_different_numbers_refuse_to_start_unless_the_environment_settles_it() -> None:
    a = Agent("a", MockModel(["x"]), model_limit=ModelLimit("acct", concurrent=2))
    b = Agent("b", MockModel(["x"]), model_limit=ModelLimit("acct", concurrent=3))
    lead = Agent("lead", MockModel(["x"]), handoffs=[b])
    with pytest.raises(errors.ConfigurationError, match="different numbers"):
        slots.settled_limits([a, lead], {})
    assert slots.settled_limits([a, lead], {"acct": ONE}) == {"acct": ONE}
    # The environment's numbers are the ones a step holds the key to
    assert slots.limit_of(a, {"acct": ONE}) == ONE and slots.limit_of(a, {}) == a.model_limit


def test_the_fairness_key_sent_with_input_becomes_the_runs() -> None:
    runtime, model_slots = _runtime(Agent("limited", MockModel(["done"]), model_limit=ONE))
    assert model_slots.acquire(ONE, "elsewhere", "limited").granted
    runtime.store.append_input("r-1", "limited", normalize_input("hi"), fairness_key="tenant-acme")
    assert runtime.step("r-1") == Outcome.WAITING
    with pytest.raises(errors.ConfigurationError, match="fairness key"):
        runtime.store.append_input("r-1", "limited", normalize_input("hi"), fairness_key="bad key")
    with pytest.raises(errors.ConfigurationError, match="reserved"):
        runtime.store.append_input("r-1", "limited", normalize_input("hi"), metadata={"lousho.fairness_key": "x"})
    model_slots.release(ONE, "elsewhere")
    assert runtime.step("r-1") == Outcome.FINISHED
    assert runtime.checkpoint("r-1").fairness_key == "tenant-acme"


def test_the_webhook_fairness_setting_parses_and_refuses_nonsense() -> None:
    secret = SecretStr("whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    config = WebhookConfig.from_settings(
        Settings(webhook_secrets=secret, webhook_fairness="desk=/tenant, *=header:X-Tenant")
    )
    assert config.fairness_source("desk") == "/tenant" and config.fairness_source("other") == "header:x-tenant"
    with pytest.raises(errors.ConfigurationError, match="LOUSHO_WEBHOOK_FAIRNESS"):
        WebhookConfig.from_settings(
            Settings(
                webhook_secrets=SecretStr("whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"), webhook_fairness="desk=tenant"
            )
        )
