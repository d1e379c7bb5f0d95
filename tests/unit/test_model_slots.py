"""Model limits: the slot contract on ``RedisModelSlots`` over fakeredis (Lua) and on the in-memory twin, then the
parsing of ``LOUSHO_MODEL_LIMITS`` and ``LOUSHO_FAIRNESS_WEIGHTS`` and the settling of an agent's numbers."""

from __future__ import annotations

import time
from collections.abc import Callable

import fakeredis
import pytest

from store import errors
from store.memory import MemoryModelSlots
from store.model_limit import ModelLimit, parse_fairness_weights, parse_model_limits, settle
from store.model_slots import RedisModelSlots
from tests.fakes import slot_contract
from tests.fakes.clock import FakeClock


def _redis_subject() -> slot_contract.SlotSubject:
    client = fakeredis.FakeRedis()
    return slot_contract.SlotSubject(
        slots=RedisModelSlots(client, slot_contract.TTL_MS), elapse=time.sleep, lose_everything=client.flushall
    )


def _memory_subject() -> slot_contract.SlotSubject:
    clock = FakeClock()
    slots = MemoryModelSlots(slot_contract.TTL_MS, clock)
    return slot_contract.SlotSubject(
        slots=slots, elapse=lambda seconds: clock.advance(seconds), lose_everything=slots.flush_all
    )


@pytest.mark.parametrize("make", [_redis_subject, _memory_subject], ids=["redis-lua", "memory"])
@pytest.mark.parametrize("check", slot_contract.CHECKS, ids=lambda check: check.__name__.removeprefix("check_"))
def test_model_slots_keep_the_slot_contract(
    check: Callable[[slot_contract.SlotFactory], None], make: slot_contract.SlotFactory
) -> None:
    check(make)


def test_the_environment_writes_limits_as_design_says() -> None:
    limits = parse_model_limits("openai-main=concurrent:8,rpm:500,tpm:200000; anthropic=concurrent:4;")
    assert limits == {
        "openai-main": ModelLimit("openai-main", concurrent=8, requests_per_minute=500, tokens_per_minute=200000),
        "anthropic": ModelLimit("anthropic", concurrent=4),
    }
    assert limits["openai-main"].describe() == "openai-main=concurrent:8,rpm:500,tpm:200000"
    assert parse_model_limits("") == {}


@pytest.mark.parametrize(
    "text",
    [
        "openai",
        "openai=concurrent",
        "openai=burst:3",
        "openai=concurrent:0",
        "bad key=concurrent:1",
        "a=concurrent:1;a=rpm:2",
        "openai=concurrent:-1",
    ],
)
def test_a_limit_that_does_not_parse_is_refused(text: str) -> None:
    with pytest.raises(errors.ConfigurationError):
        parse_model_limits(text)


def test_fairness_weights_parse_and_refuse_nonsense() -> None:
    assert parse_fairness_weights("acme=2, globex=3") == {"acme": 2, "globex": 3}
    for text in ("acme", "acme=0", "acme=x", "~=2"):
        with pytest.raises(errors.ConfigurationError):
            parse_fairness_weights(text)


def test_agents_that_give_one_key_different_numbers_refuse_unless_the_environment_settles_it() -> None:
    four, eight = ModelLimit("openai", concurrent=4), ModelLimit("openai", concurrent=8)
    assert settle([("a", four), ("b", four)], {}) == {"openai": four}
    with pytest.raises(errors.ConfigurationError, match="different numbers"):
        settle([("a", four), ("b", eight)], {})
    two = ModelLimit("openai", concurrent=2)
    assert settle([("a", four), ("b", eight)], {"openai": two}) == {"openai": two}


def test_a_model_limit_refuses_numbers_below_one_and_bad_keys() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        ModelLimit("openai", concurrent=0)
    with pytest.raises(errors.ConfigurationError, match="invalid model limit key"):
        ModelLimit("lousho:lease:x")
