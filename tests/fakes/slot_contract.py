"""The model-limit contract: checks every implementation of ``store.interfaces.ModelSlots`` must pass, given a factory.

The unit tier runs them against ``RedisModelSlots`` over fakeredis (with Lua) and against
``store.memory.MemoryModelSlots``; the integration tier runs them against real Redis.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from store import interfaces
from store.model_limit import ModelLimit

#: The slot TTL the factories give (ms): short, so expiry can be shown by sleeping past it against real Redis.
TTL_MS = 400


@dataclass
class SlotSubject:
    """Limits under test, and what happens to them from outside."""

    slots: interfaces.ModelSlots
    #: Time passes (seconds): a fake clock moves, or the test sleeps.
    elapse: Callable[[float], object]
    #: The service loses every key (a restart without persistence).
    lose_everything: Callable[[], object]


SlotFactory = Callable[[], SlotSubject]


def check_concurrent_slots_hold_and_a_release_wakes_the_next_waiter(make: SlotFactory) -> None:
    slots = make().slots
    limit = ModelLimit("sc-two", concurrent=2)
    assert slots.acquire(limit, "sc-a", "agent").granted
    assert slots.acquire(limit, "sc-b", "agent").granted
    third = slots.acquire(limit, "sc-c", "agent")
    assert not third.granted and third.reason == "slot" and third.wait_s == 0
    assert slots.waiting(["sc-a", "sc-c"]) == {"sc-c": ("sc-two", "slot")}
    assert [(u.key, u.in_use, u.waiting) for u in slots.usage()] == [("sc-two", 2, 1)]
    # A newcomer does not jump the line while a slot is kept for the woken waiter.
    assert slots.release(limit, "sc-a") == (("sc-c", "agent"),)
    assert not slots.acquire(limit, "sc-d", "agent").granted
    assert slots.acquire(limit, "sc-c", "agent").granted
    assert slots.waiting(["sc-c", "sc-d"]) == {"sc-d": ("sc-two", "slot")}
    assert slots.release(limit, "sc-b") == (("sc-d", "agent"),)


def check_freed_slots_go_round_robin_by_fairness_key(make: SlotFactory) -> None:
    slots = make().slots
    limit = ModelLimit("sc-fair", concurrent=1)
    assert slots.acquire(limit, "sc-holder", "agent").granted
    for n in range(3):
        assert not slots.acquire(limit, f"sc-a{n}", "agent", "acme").granted
    assert not slots.acquire(limit, "sc-b0", "other", "globex").granted
    served = []
    holder = "sc-holder"
    for _ in range(4):
        ((woken, agent),) = slots.release(limit, holder)
        served.append((woken, agent))
        assert slots.acquire(limit, woken, agent).granted
        holder = woken
    assert served == [("sc-a0", "agent"), ("sc-b0", "other"), ("sc-a1", "agent"), ("sc-a2", "agent")]


def check_a_weight_gives_a_key_more_of_the_freed_slots(make: SlotFactory) -> None:
    slots = make().slots
    limit = ModelLimit("sc-weight", concurrent=1)
    assert slots.acquire(limit, "sc-w-holder", "agent").granted
    for n in range(4):
        assert not slots.acquire(limit, f"sc-w-a{n}", "agent", "acme", weight=2).granted
        assert not slots.acquire(limit, f"sc-w-b{n}", "agent", "globex").granted
    order, holder = [], "sc-w-holder"
    for _ in range(6):
        ((woken, _agent),) = slots.release(limit, holder)
        assert slots.acquire(limit, woken, "agent").granted
        order.append(woken[5])
        holder = woken
    assert order.count("a") == 4 and order.count("b") == 2


def check_a_dead_holder_frees_its_slot_within_the_ttl_and_a_renewal_keeps_it(make: SlotFactory) -> None:
    subject = make()
    slots, limit = subject.slots, ModelLimit("sc-ttl", concurrent=1)
    assert slots.acquire(limit, "sc-dead", "agent").granted
    assert not slots.acquire(limit, "sc-next", "agent").granted
    subject.elapse(TTL_MS * 0.6 / 1000)
    assert slots.renew("sc-ttl", ["sc-dead"]) == 1
    subject.elapse(TTL_MS * 0.6 / 1000)
    assert slots.wake() == ()  # renewed: still held
    subject.elapse(TTL_MS * 1.2 / 1000)
    assert slots.wake() == (("sc-next", "agent"),)  # never released, never renewed: expired
    assert slots.acquire(limit, "sc-next", "agent").granted


def check_requests_per_minute_make_the_next_call_wait(make: SlotFactory) -> None:
    slots = make().slots
    limit = ModelLimit("sc-rpm", requests_per_minute=2)
    for run in ("sc-r1", "sc-r2"):
        assert slots.acquire(limit, run, "agent").granted
        slots.release(limit, run)
    third = slots.acquire(limit, "sc-r3", "agent")
    assert not third.granted and third.reason == "requests" and 0 < third.wait_s <= 30
    assert slots.waiting(["sc-r3"]) == {"sc-r3": ("sc-rpm", "requests")}


def check_tokens_are_counted_from_reported_usage(make: SlotFactory) -> None:
    slots = make().slots
    limit = ModelLimit("sc-tpm", tokens_per_minute=100)
    assert slots.acquire(limit, "sc-t1", "agent").granted
    slots.release(limit, "sc-t1", tokens=150)
    second = slots.acquire(limit, "sc-t2", "agent")
    assert not second.granted and second.reason == "tokens" and 25 <= second.wait_s <= 31


def check_a_cool_down_holds_every_caller_of_the_key(make: SlotFactory) -> None:
    subject = make()
    slots = subject.slots
    limit, other = ModelLimit("sc-cool", concurrent=4), ModelLimit("sc-warm", concurrent=4)
    slots.cool_down("sc-cool", 0.3)
    slots.cool_down("sc-cool", 0.1)  # a shorter one does not cut it
    held = slots.acquire(limit, "sc-c1", "agent")
    assert not held.granted and held.reason == "cool-down" and 0.15 < held.wait_s <= 0.3
    assert slots.acquire(other, "sc-c2", "agent").granted
    assert [(u.key, u.cooling_s > 0) for u in slots.usage()] == [("sc-cool", True), ("sc-warm", False)]
    subject.elapse(0.35)
    assert slots.acquire(limit, "sc-c1", "agent").granted


def check_the_smallest_number_two_callers_give_a_key_holds(make: SlotFactory) -> None:
    # Two releases of a fleet give one key different numbers during a deploy: neither exceeds the smaller.
    slots = make().slots
    older, newer = ModelLimit("sc-deploy", concurrent=3), ModelLimit("sc-deploy", concurrent=1)
    assert slots.acquire(older, "sc-d1", "agent").granted
    assert not slots.acquire(newer, "sc-d2", "agent").granted
    assert not slots.acquire(older, "sc-d3", "agent").granted
    assert slots.usage()[0].in_use == 1


def check_everything_lost_grants_again_until_the_calls_in_flight_renew(make: SlotFactory) -> None:
    subject = make()
    limit = ModelLimit("sc-lost", concurrent=1)
    assert subject.slots.acquire(limit, "sc-l1", "agent").granted
    subject.lose_everything()
    assert subject.slots.waiting(["sc-l1"]) == {}
    # Between the loss and the renewal of the call in flight, one call more is admitted (I20's excess) ...
    assert subject.slots.acquire(limit, "sc-l2", "agent").granted
    # ... then the renewal counts the call in flight again, and nobody else is admitted until both end
    assert subject.slots.renew("sc-lost", ["sc-l1"]) == 0
    assert [u.in_use for u in subject.slots.usage()] == [2]
    assert not subject.slots.acquire(limit, "sc-l3", "agent").granted
    subject.slots.release(limit, "sc-l2")
    assert subject.slots.release(limit, "sc-l1") == (("sc-l3", "agent"),)


CHECKS = [
    check_concurrent_slots_hold_and_a_release_wakes_the_next_waiter,
    check_freed_slots_go_round_robin_by_fairness_key,
    check_a_weight_gives_a_key_more_of_the_freed_slots,
    check_a_dead_holder_frees_its_slot_within_the_ttl_and_a_renewal_keeps_it,
    check_requests_per_minute_make_the_next_call_wait,
    check_tokens_are_counted_from_reported_usage,
    check_a_cool_down_holds_every_caller_of_the_key,
    check_the_smallest_number_two_callers_give_a_key_holds,
    check_everything_lost_grants_again_until_the_calls_in_flight_renew,
]
