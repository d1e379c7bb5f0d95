"""Append-only transcripts: slots, what a save writes, and what a process remembers."""

from __future__ import annotations

from store import transcripts
from store.records import Message, ToolCall
from store.transcripts import Known, Transcripts, diff, slots_of, stable_prefix


def _turn(*ids: str) -> Message:
    return Message(role="assistant", tool_calls=[ToolCall(id=i, name="t") for i in ids])


def _result(call_id: str, text: str = "ok") -> Message:
    return Message(role="tool", tool_call_id=call_id, name="t", content=text)


HEAD = [Message(role="system", content="be brief"), Message(role="user", content="go")]


def _known(messages: list[Message], seq: int = 1) -> Known:
    slots = slots_of(messages)
    rows = [(slot, m.dump(), 10) for slot, m in zip(slots, messages, strict=True)]
    known = transcripts.from_rows(7, seq, rows)
    # A claim keeps the objects it parsed; the step's checkpoint shares them.
    known.messages = list(messages)
    return known


def test_slots_are_indexes_except_for_results_of_an_unfinished_batch() -> None:
    assert slots_of(HEAD) == [0, 1]
    assert slots_of([*HEAD, _turn("a", "b", "c"), _result("c")]) == [0, 1, 2, 5]
    assert slots_of([*HEAD, _turn("a", "b", "c"), _result("a"), _result("c")]) == [0, 1, 2, 3, 5]
    done = [*HEAD, _turn("a", "b"), _result("a"), _result("b"), Message(role="assistant", content="done")]
    assert slots_of(done) == list(range(len(done)))


def test_results_that_do_not_follow_the_rule_keep_their_indexes() -> None:
    unknown = [*HEAD, _turn("a"), _result("zz")]
    assert slots_of(unknown) == [0, 1, 2, 3]
    twice = [*HEAD, _turn("a", "b"), _result("b"), _result("b")]
    assert slots_of(twice) == [0, 1, 2, 3, 4]


def test_the_stable_prefix_stops_at_a_turn_whose_results_are_still_coming() -> None:
    partial = [*HEAD, _turn("a", "b"), _result("b")]
    assert stable_prefix(partial, slots_of(partial)) == 3
    whole = [*partial[:3], _result("a"), _result("b")]
    assert stable_prefix(whole, slots_of(whole)) == 5


def test_an_appending_save_serializes_only_what_it_adds() -> None:
    before = [*HEAD, _turn("a")]
    known = _known(before)
    after = [*before, _result("a", "x" * 100)]
    rows = diff(known, after)
    assert [(slot, m) for slot, m, _ in rows.added] == [(3, after[3])]
    assert rows.gone == [] and not rows.rewrites
    assert rows.body.startswith("[[3,") and rows.body.count('"role"') == 1
    assert rows.total_bytes == known.bytes + rows.added[0][2]


def test_a_result_placed_before_one_already_stored_is_added_at_its_slot() -> None:
    before = [*HEAD, _turn("a", "b"), _result("b")]
    known = _known(before)
    after = [*before[:3], _result("a"), before[3]]
    rows = diff(known, after)
    assert [slot for slot, _, _ in rows.added] == [3] and not rows.rewrites
    remembered = transcripts.after_save(known, rows, 2, after, 7)
    assert remembered.slots == [0, 1, 2, 3, 4] and remembered.stable == 5


def test_equal_messages_loaded_again_are_not_written_again() -> None:
    before = [*HEAD, _turn("a")]
    known = _known(before)
    copies = [m.model_copy() for m in before]
    rows = diff(known, [*copies, _result("a")])
    assert [slot for slot, _, _ in rows.added] == [3] and not rows.rewrites


def test_a_changed_or_dropped_stored_message_is_a_rewrite() -> None:
    before = [*HEAD, _turn("a"), _result("a"), Message(role="user", content="more")]
    known = _known(before)
    changed = [Message(role="system", content="other"), *before[1:]]
    rows = diff(known, changed)
    assert rows.rewrites and [slot for slot, _, _ in rows.added] == [0]
    shorter = diff(known, before[:2])
    assert shorter.rewrites and shorter.gone == [2, 3, 4] and shorter.added == []


def test_a_transcript_past_what_is_remembered_is_extended_from_the_stable_prefix() -> None:
    before = [*HEAD, _turn("a", "b"), _result("b")]
    known = _known(before)
    assert known.stable == 3  # a claim asks for the rows from slot 3 on: the turn's results may still move
    tail = [
        (3, _result("a").dump(), 5),
        (4, before[3].dump(), 5),
        (5, Message(role="assistant", content="done").dump(), 5),
    ]
    extended = transcripts.extend(known, 7, 4, tail)
    assert [m.dump() for m in extended.messages] == [m.dump() for m in [*before[:3], _result("a"), before[3]]] + [
        {"role": "assistant", "content": "done"}
    ]
    assert extended.messages[0] is before[0]  # the prefix is reused, not parsed again


def test_rows_are_read_back_as_the_messages_written() -> None:
    message = Message(role="assistant", content="hi", tool_calls=[ToolCall(id="c", name="t", args={"x": [1]})])
    again = transcripts.message_from_row(message.dump())
    assert again == message and again.tool_calls is not None and again.tool_calls[0].args == {"x": [1]}


def test_a_process_remembers_a_bounded_number_of_runs_and_bytes() -> None:
    remembered = Transcripts(runs=2, max_bytes=1000)
    for name in ("a", "b", "c"):
        remembered.remember(name, Known(1, 1, [], [], [], bytes=100))
    assert remembered.get("a") is None and len(remembered) == 2
    remembered.remember("big", Known(1, 1, [], [], [], bytes=600))  # over half the budget: not kept
    assert remembered.get("big") is None
    remembered.remember("d", Known(1, 1, [], [], [], bytes=450))
    remembered.remember("e", Known(1, 1, [], [], [], bytes=450))
    assert remembered.get("d") is not None and remembered.get("e") is not None and len(remembered) == 2
    remembered.forget("d")
    assert remembered.get("d") is None


def test_a_run_not_stepped_for_a_while_is_forgotten() -> None:
    now = [0.0]
    remembered = Transcripts(runs=10, max_bytes=10_000, max_age_s=30, clock=lambda: now[0])
    remembered.remember("slow", Known(1, 1, [], [], [], bytes=10))
    remembered.remember("busy", Known(1, 1, [], [], [], bytes=10))
    now[0] = 20.0
    assert remembered.get("busy") is not None
    now[0] = 40.0
    remembered.remember("new", Known(1, 1, [], [], [], bytes=10))
    assert remembered.get("slow") is None and remembered.get("busy") is not None and len(remembered) == 2
