"""Sub-agent child ids: derived from the lead, its step and the call alone, the same in every process."""

from __future__ import annotations

import re

from store import records
from worker import subagents


def test_a_child_id_is_the_same_for_the_same_call_in_any_process() -> None:
    # A step that runs again (its worker died after starting the child) must find the child it started, in
    # whatever process it runs: the id is a digest of the lead, the step and the call, nothing else.
    first = subagents.child_id("order-7", 3, "call_abc")
    assert first == subagents.child_id("order-7", 3, "call_abc")
    assert first == "order-7.task-62ef9cad628ba98d"  # the same digest in every process and release
    assert first is not None and re.fullmatch(r"order-7\.task-[0-9a-f]{16}", first)
    assert records.lead_of(first) == "order-7" and records.is_child_id(first)
    others = {
        subagents.child_id("order-7", 4, "call_abc"),
        subagents.child_id("order-7", 3, "call_abd"),
        subagents.child_id("order-8", 3, "call_abc"),
    }
    assert first not in others and len(others) == 3


def test_a_lead_whose_id_leaves_no_room_gets_no_child_id() -> None:
    assert subagents.child_id("x" * 178, 1, "c") is not None  # 178 + 22 = 200 characters
    assert subagents.child_id("x" * 179, 1, "c") is None
