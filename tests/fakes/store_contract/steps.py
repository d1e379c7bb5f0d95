"""Contract checks of what a step does: input, claims, fenced writes, usage noted before a write."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from store import errors, payloads, records
from store.records import LastError, Message, StepWrite, ToolCall, Usage
from tests.fakes.store_contract.subject import (
    AGENT,
    StoreFactory,
    claimed_run,
    comparable,
    new_run,
    save_next,
    user_message,
    write,
)

# -- inbox -------------------------------------------------------------------------------------


def check_append_input_creates_the_run_and_numbers_input_per_run(make: StoreFactory) -> None:
    store = make(50).store
    assert store.append_input("ct-inbox-a", AGENT, [user_message("one")]) == 1
    assert store.append_input("ct-inbox-a", AGENT, [user_message("two"), user_message("three")]) == 2
    assert store.append_input("ct-inbox-b", AGENT, [user_message("other")]) == 1

    created = store.load("ct-inbox-a")
    assert created is not None
    assert (created.agent, created.status, created.seq, created.fence, created.attempts) == (
        AGENT,
        "in-progress",
        0,
        0,
        0,
    )
    assert created.messages == [] and created.inbox_cursor == 0 and created.last_error is None
    assert created.updated_at is not None and created.updated_at.tzinfo is not None
    entries = store.inbox("ct-inbox-a", 0)
    assert [e.n for e in entries] == [1, 2]
    assert [[m.content for m in e.messages] for e in entries] == [["one"], ["two", "three"]]
    assert [e.n for e in store.inbox("ct-inbox-a", 1)] == [2]
    assert store.inbox("ct-inbox-unknown", 0) == []


def check_append_input_refuses_a_session_of_another_agent(make: StoreFactory) -> None:
    store = make(50).store
    store.append_input("ct-agent", AGENT, [user_message("mine")])
    with pytest.raises(errors.ConfigurationError):
        store.append_input("ct-agent", "someone-else", [user_message("theirs")])
    assert [e.n for e in store.inbox("ct-agent", 0)] == [1]
    loaded = store.load("ct-agent")
    assert loaded is not None and loaded.agent == AGENT


def check_append_input_refuses_a_run_awaiting_approval(make: StoreFactory) -> None:
    store = make(50).store
    checkpoint = new_run(store, "ct-paused")
    save_next(store, checkpoint, status="awaiting-approval", approval_ids=["ap-1", "ap-2"], inbox_cursor=1)
    with pytest.raises(errors.SessionAwaitingApprovalError) as raised:
        store.append_input("ct-paused", AGENT, [user_message("are you done?")])
    assert raised.value.fields == {"session_id": "ct-paused", "approval_id": "ap-1"}
    assert store.inbox("ct-paused", 0) == []


def check_append_input_keeps_metadata_with_its_input(make: StoreFactory) -> None:
    store = make(50).store
    metadata = {"plan": "pro", "limits": {"seats": 3, "regions": ["eu", "us"]}, "trial": False, "note": None}
    assert store.append_input("ct-meta", AGENT, [user_message("one")], metadata=metadata) == 1
    assert store.append_input("ct-meta", AGENT, [user_message("two")]) == 2
    assert store.append_input("ct-meta", AGENT, [user_message("three")], "key-1", {"plan": "free"}) == 3
    # A retried send keeps the first send's metadata.
    assert store.append_input("ct-meta", AGENT, [user_message("three")], "key-1", {"plan": "other"}) == 3

    entries = store.inbox("ct-meta", 0)
    assert [(e.n, e.metadata) for e in entries] == [(1, metadata), (2, None), (3, {"plan": "free"})]
    assert [m.content for m in entries[0].messages] == ["one"]


def check_append_input_refuses_metadata_that_is_not_a_small_json_object(make: StoreFactory) -> None:
    store = make(50).store
    store.append_input("ct-meta-bad", AGENT, [user_message("first")])
    deep: dict[str, Any] = {}
    inner = deep
    for _ in range(40):
        inner["next"] = {}
        inner = inner["next"]
    refused: list[tuple[Any, type[errors.LoushoError]]] = [
        (["not", "an", "object"], errors.ConfigurationError),
        ({1: "a key that is not a string"}, errors.ConfigurationError),
        ({"when": object()}, errors.ConfigurationError),
        ({"blob": "x" * (16 * 1024)}, errors.InputTooLargeError),
        (deep, errors.InputTooLargeError),
    ]
    for metadata, error in refused:
        for session_id in ("ct-meta-bad", "ct-meta-new"):
            with pytest.raises(error):
                store.append_input(session_id, AGENT, [user_message("more")], metadata=metadata)
    assert [e.n for e in store.inbox("ct-meta-bad", 0)] == [1]
    assert store.load("ct-meta-new") is None and store.inbox("ct-meta-new", 0) == []


def check_append_input_refuses_input_that_leaves_no_room_for_a_reply(make: StoreFactory) -> None:
    store = make(50).store

    def megabytes(letters: str) -> list[Message]:
        return [user_message(letter * payloads.MAX_INPUT_STRING) for letter in letters]

    # Queued input counts: two sends of 3 MiB fit, a third would leave less than a reply's room.
    assert store.append_input("ct-room", AGENT, megabytes("abc")) == 1
    assert store.append_input("ct-room", AGENT, megabytes("def")) == 2
    with pytest.raises(errors.InputTooLargeError) as refused:
        store.append_input("ct-room", AGENT, megabytes("ghi"))
    assert refused.value.fields["session_id"] == "ct-room"
    size = refused.value.fields["size"]
    assert isinstance(size, int) and size + payloads.REPLY_ROOM > payloads.MAX_CHECKPOINT
    assert "fork" in refused.value.message
    assert [e.n for e in store.inbox("ct-room", 0)] == [1, 2]

    # So does the stored transcript, once the input is merged.
    checkpoint = claimed_run(store, "ct-room", 1)
    merged = [m for e in store.inbox("ct-room", 0) for m in e.messages]
    save_next(store, checkpoint, messages=merged, inbox_cursor=2)
    with pytest.raises(errors.InputTooLargeError):
        store.append_input("ct-room", AGENT, megabytes("gh"))
    assert store.append_input("ct-room", AGENT, [user_message("a short question")]) == 3


# -- claim -------------------------------------------------------------------------------------


def check_claim_of_an_unknown_run_loads_nothing(make: StoreFactory) -> None:
    store = make(50).store
    assert store.claim("ct-nobody", 7, None) == records.Claim(None, stored_fence=None)


def check_claim_takes_a_higher_token_and_refuses_an_equal_or_lower_one(make: StoreFactory) -> None:
    store = make(50).store
    store.append_input("ct-claim", AGENT, [user_message("hi")])
    claim = store.claim("ct-claim", 5, None)
    assert claim.checkpoint is not None and claim.checkpoint.fence == 5 and claim.inbox_head == 1
    assert store.claim("ct-claim", 5, None) == records.Claim(None, stored_fence=5)
    assert store.claim("ct-claim", 3, None) == records.Claim(None, stored_fence=5)
    assert claimed_run(store, "ct-claim", 6).fence == 6
    loaded = store.load("ct-claim")
    assert loaded is not None and loaded.fence == 6


def check_claim_counts_an_attempt_only_when_the_step_has_work(make: StoreFactory) -> None:
    store = make(50).store
    store.append_input("ct-attempts", AGENT, [user_message("hi")])
    assert claimed_run(store, "ct-attempts", 1).attempts == 1  # in progress, no seq given
    assert claimed_run(store, "ct-attempts", 2, seq=0).attempts == 2  # in progress, matching seq
    current = claimed_run(store, "ct-attempts", 3, seq=9)  # a stale message: no attempt
    assert current.attempts == 2

    save_next(store, current, status="finished", inbox_cursor=1)
    assert claimed_run(store, "ct-attempts", 4).attempts == 0  # finished, nothing new to do
    store.append_input("ct-attempts", AGENT, [user_message("more")])
    assert claimed_run(store, "ct-attempts", 5).attempts == 1  # finished with new input


# -- save ---------------------------------------------------------------------------------------


def check_save_is_fenced_and_takes_exactly_the_next_seq(make: StoreFactory) -> None:
    store = make(50).store
    first = new_run(store, "ct-save")
    saved_at = write(store, first.model_copy(update={"seq": 1, "step": 1}))
    assert saved_at is not None and saved_at.tzinfo is not None
    assert write(store, first.model_copy(update={"seq": 1, "step": 2})) is None  # same seq twice
    assert write(store, first.model_copy(update={"seq": 3, "step": 3})) is None  # a gap

    second = claimed_run(store, "ct-save", 2)
    # The first holder's token was replaced: its save is refused before the new holder saved.
    assert write(store, first.model_copy(update={"seq": 2, "step": 99})) is None
    loaded = store.load("ct-save")
    assert loaded is not None and (loaded.seq, loaded.step, loaded.fence) == (1, 1, 2)
    assert write(store, second.model_copy(update={"seq": 2, "step": 2})) is not None
    assert [(e.seq, e.checkpoint.fence) for e in store.history("ct-save")] == [(2, 2), (1, 1)]


def check_save_clears_attempts_and_the_last_error(make: StoreFactory) -> None:
    store = make(50).store
    checkpoint = new_run(store, "ct-clear")
    assert store.record_failure("ct-clear", checkpoint.fence, LastError(code="X", message="boom", retryable=True)) == 1
    failed = store.load("ct-clear")
    assert failed is not None and failed.last_error == LastError(code="X", message="boom", retryable=True)
    save_next(store, checkpoint, step=1)
    loaded = store.load("ct-clear")
    assert loaded is not None and loaded.attempts == 0 and loaded.last_error is None


def check_owed_run_end_hooks_give_a_finished_run_work_until_a_fenced_note(make: StoreFactory) -> None:
    subject = make(50)
    store = subject.store
    checkpoint = new_run(store, "ct-end")
    ended = save_next(store, checkpoint, status="finished", finish_reason="stop", inbox_cursor=1, end_due=True)
    subject.tick()
    loaded = store.load("ct-end")
    assert loaded is not None and loaded.end_due is True
    assert "ct-end" in [due.session_id for due in store.due_runs(0.0)]  # the sweep sends it a step
    assert store.settle_end("ct-end", ended.fence + 1, ended.seq) is False  # another holder's note
    assert store.settle_end("ct-end", ended.fence, ended.seq - 1) is False  # a note about an earlier save
    assert store.settle_end("ct-end", ended.fence, ended.seq) is True
    assert store.settle_end("ct-end", ended.fence, ended.seq) is False  # noted once
    settled = store.load("ct-end")
    assert settled is not None and settled.end_due is False
    assert "ct-end" not in [due.session_id for due in store.due_runs(0.0)]


def check_children_are_started_once_and_a_lead_waiting_on_settled_ones_is_listed(make: StoreFactory) -> None:
    subject = make(50)
    store = subject.store
    lead = new_run(store, "ct-lead")
    child = "ct-lead.task-0123456789abcdef"
    assert store.start_children("ct-lead", AGENT, [(child, AGENT, "look it up")], fence=lead.fence) == []
    # A step that ran again finds its child as it left it.
    assert store.start_children("ct-lead", AGENT, [(child, AGENT, "look it up")], fence=lead.fence) == []
    assert [e.n for e in store.inbox(child, 0)] == [1]
    started = store.load(child)
    assert started is not None and started.lead_agent == AGENT and started.agent == AGENT
    waiting = save_next(store, lead, inbox_cursor=1, waiting=True, delegated={"call-1": child})
    subject.tick()
    assert "ct-lead" not in [d.session_id for d in store.due_runs(0.0)]  # no step due while it waits
    assert store.waiting_leads(0.0) == []  # its child can still move
    assert "ct-lead" in [p.session_id for p in store.pending()]
    settled = claimed_run(store, child, 5)
    save_next(store, settled, status="finished", finish_reason="stop", inbox_cursor=1)
    subject.tick()
    assert [lead.session_id for lead in store.waiting_leads(0.0)] == ["ct-lead"]
    loaded = store.load("ct-lead")
    assert loaded is not None and loaded.waiting and loaded.seq == waiting.seq


def check_children_are_started_under_the_leads_fence_and_never_adopted(make: StoreFactory) -> None:
    store = make(50).store
    lead = new_run(store, "ct-fenced")
    mine, taken = "ct-fenced.task-00000000000000a1", "ct-fenced.task-00000000000000a2"
    store.append_input(taken, AGENT, [user_message("not the lead's")])  # a run that took a child's id

    with pytest.raises(errors.FencedOutError):
        store.start_children("ct-fenced", AGENT, [(mine, AGENT, "look")], fence=lead.fence - 1)
    assert store.load(mine) is None
    assert store.start_children(
        "ct-fenced", AGENT, [(mine, AGENT, "look"), (taken, AGENT, "look")], fence=lead.fence
    ) == [taken]
    started, other = store.load(mine), store.load(taken)
    assert started is not None and started.lead_agent == AGENT
    assert other is not None and other.lead_agent is None and [e.n for e in store.inbox(taken, 0)] == [1]

    assert store.claim(mine, 3, None).lead_gone is False
    store.delete("ct-fenced")  # every run under its id goes with it
    assert store.load(mine) is None and store.load(taken) is None
    with pytest.raises(errors.FencedOutError):
        store.start_children("ct-fenced", AGENT, [(mine, AGENT, "look")], fence=lead.fence)
    assert store.load(mine) is None


def check_a_lead_waiting_on_children_that_are_all_gone_is_listed(make: StoreFactory) -> None:
    subject = make(50)
    store = subject.store
    lead = new_run(store, "ct-bereft")
    child = "ct-bereft.task-00000000000000d1"
    assert store.start_children("ct-bereft", AGENT, [(child, AGENT, "look")], fence=lead.fence) == []
    save_next(store, lead, inbox_cursor=1, waiting=True, delegated={"call-1": child})
    subject.tick()
    assert store.waiting_leads(0.0) == []  # its child can still move

    store.delete(child)  # no child is left to wake it
    subject.tick()

    assert [due.session_id for due in store.waiting_leads(0.0)] == ["ct-bereft"]


def check_a_lead_whose_child_settled_before_its_last_save_is_listed(make: StoreFactory) -> None:
    # The child settles while the lead's step holds the lease (its wake-up is dropped as busy); the lead's save,
    # made from what it read before, still names the child and comes after the child's.
    subject = make(50)
    store = subject.store
    lead = new_run(store, "ct-raced")
    child = "ct-raced.task-00000000000000e1"
    assert store.start_children("ct-raced", AGENT, [(child, AGENT, "look")], fence=lead.fence) == []
    save_next(store, claimed_run(store, child, 5), status="finished", finish_reason="stop", inbox_cursor=1)
    subject.tick()

    save_next(store, lead, inbox_cursor=1, waiting=True, delegated={"call-1": child})
    subject.tick()

    assert [due.session_id for due in store.waiting_leads(0.0)] == ["ct-raced"]


def check_a_lead_waiting_at_its_answer_on_a_task_that_settled_before_its_save_is_listed(make: StoreFactory) -> None:
    subject = make(50)
    store = subject.store
    lead = new_run(store, "ct-awaits")
    task = "ct-awaits.task-00000000000000e2"
    assert store.start_children("ct-awaits", AGENT, [(task, AGENT, "look")], fence=lead.fence) == []
    save_next(store, claimed_run(store, task, 5), status="finished", finish_reason="stop", inbox_cursor=1)
    subject.tick()

    save_next(store, lead, inbox_cursor=1, waiting=True, background=[task])
    subject.tick()

    assert [due.session_id for due in store.waiting_leads(0.0)] == ["ct-awaits"]


def check_a_lead_paused_on_its_childs_approval_is_not_listed_again(make: StoreFactory) -> None:
    subject = make(50)
    store = subject.store
    lead = new_run(store, "ct-asks")
    child = "ct-asks.task-00000000000000e3"
    assert store.start_children("ct-asks", AGENT, [(child, AGENT, "look")], fence=lead.fence) == []
    save_next(store, claimed_run(store, child, 5), status="awaiting-approval", approval_ids=["ap-1"], inbox_cursor=1)
    subject.tick()

    save_next(
        store,
        lead,
        inbox_cursor=1,
        waiting=True,
        delegated={"call-1": child},
        status="awaiting-approval",
        approval_ids=["ap-1"],
    )
    subject.tick()

    assert store.waiting_leads(0.0) == []  # a person's decision moves the child, which then wakes the lead


def check_save_round_trips_the_whole_document(make: StoreFactory) -> None:
    store = make(50).store
    checkpoint = new_run(store, "ct-doc")
    call = ToolCall(id="call-1", name="charge", args={"amount": 5.5, "tags": ["a", "b"], "meta": {"n": 10**30}})
    messages = [
        Message(role="system", content="be brief"),
        Message(role="user", content='100% _sure_ \'; DROP TABLE runs; -- \u65e5\u672c \U0001f680 \\u0000 "q"'),
        Message(role="assistant", content=None, tool_calls=[call]),
        Message(role="tool", tool_call_id="call-1", name="charge", content='{"error": "no"}', is_error=True),
        Message(role="assistant", content="done"),
    ]
    saved = save_next(
        store,
        checkpoint,
        messages=messages,
        step=2,
        status="finished",
        finish_reason="stop",
        usage=Usage(input_tokens=3, output_tokens=4, total_tokens=7),
        run_start=1,
        business_state={"cart": [1, 2, {"x": None}], "flag": True, "ratio": 0.25},
        fingerprint={"hash": "abc"},
        started_tool_call_ids=["call-1"],
        inbox_cursor=1,
    )
    loaded = store.load("ct-doc")
    assert loaded is not None
    assert comparable(loaded) == comparable(saved)
    assert loaded.inbox_cursor == 1
    (entry,) = store.history("ct-doc")
    assert comparable(entry.checkpoint) == comparable(saved)


def check_save_trims_the_drained_inbox(make: StoreFactory) -> None:
    store = make(50).store
    checkpoint = new_run(store, "ct-drain")
    store.append_input("ct-drain", AGENT, [user_message("two")])
    store.append_input("ct-drain", AGENT, [user_message("three")])
    kept = checkpoint.model_copy(update={"seq": 1, "inbox_cursor": 1})
    assert write(store, kept) is not None
    assert [e.n for e in store.inbox("ct-drain", 0)] == [1, 2, 3]  # not drained: kept
    drained = kept.model_copy(update={"seq": 2, "inbox_cursor": 2})
    assert write(store, drained, drained_inbox=True) is not None
    assert [e.n for e in store.inbox("ct-drain", 0)] == [3]
    loaded = store.load("ct-drain")
    assert loaded is not None and loaded.inbox_cursor == 2


def check_save_refuses_an_oversized_checkpoint_and_writes_nothing(make: StoreFactory) -> None:
    store = make(50).store
    checkpoint = new_run(store, "ct-huge")
    huge = checkpoint.model_copy(update={"seq": 1, "messages": [user_message("x" * (payloads.MAX_CHECKPOINT + 1))]})
    with pytest.raises(errors.InputTooLargeError):
        write(store, huge)
    loaded = store.load("ct-huge")
    assert loaded is not None and loaded.seq == 0 and store.history("ct-huge") == []


def check_save_refuses_a_nul_as_postgres_does(make: StoreFactory) -> None:
    store = make(50).store
    checkpoint = new_run(store, "ct-nul")
    with pytest.raises(errors.StorageError):
        write(store, checkpoint.model_copy(update={"seq": 1, "business_state": {"k": "a\x00b"}}))
    loaded = store.load("ct-nul")
    assert loaded is not None and loaded.seq == 0 and store.history("ct-nul") == []


def check_a_write_that_says_what_it_added_keeps_the_whole_run(make: StoreFactory) -> None:
    store = make(50).store
    first = save_next(store, new_run(store, "ct-added"), step=1, messages=[user_message("one")])
    second = first.model_copy(
        update={"seq": 2, "step": 2, "messages": [*first.messages, Message(role="assistant", content="two")]}
    )
    step = StepWrite(checkpoint=second, first_new_message=1)
    assert [m.content for m in step.new_messages] == ["two"]
    assert store.record_step(step) is not None
    loaded = store.load("ct-added")
    assert loaded is not None and [m.content for m in loaded.messages] == ["one", "two"]
    assert [[m.content for m in e.checkpoint.messages] for e in store.history("ct-added")] == [["one", "two"], ["one"]]


# -- usage noted before a write -----------------------------------------------------------------


def check_note_usage_is_fenced_and_counted_until_the_next_write(make: StoreFactory) -> None:
    store = make(50).store
    checkpoint = new_run(store, "ct-usage")
    first = Usage(input_tokens=2, output_tokens=3, total_tokens=5)
    noted = Usage(input_tokens=4, output_tokens=5, total_tokens=9)
    assert store.note_usage("ct-usage", checkpoint.fence + 1, first) is False  # not the holder's fence
    assert store.note_usage("ct-nobody", 1, first) is False
    assert store.note_usage("ct-usage", checkpoint.fence, first) is True
    assert store.note_usage("ct-usage", checkpoint.fence, noted) is True  # replaces, never adds
    loaded = store.load("ct-usage")
    assert loaded is not None and (loaded.usage, loaded.uncounted_usage) == (noted, noted)

    # The next holder sees the usage too; its write counts it in the checkpoint, and nothing is left uncounted.
    taken = claimed_run(store, "ct-usage", checkpoint.fence + 1)
    assert (taken.usage, taken.uncounted_usage) == (noted, noted)
    save_next(store, taken, step=1)
    loaded = store.load("ct-usage")
    assert loaded is not None and (loaded.usage, loaded.uncounted_usage) == (noted, None)
    assert store.note_usage("ct-usage", checkpoint.fence, first) is False  # the old holder is fenced out


CHECKS: tuple[Callable[[StoreFactory], None], ...] = (
    check_append_input_creates_the_run_and_numbers_input_per_run,
    check_append_input_refuses_a_session_of_another_agent,
    check_append_input_refuses_a_run_awaiting_approval,
    check_append_input_keeps_metadata_with_its_input,
    check_append_input_refuses_metadata_that_is_not_a_small_json_object,
    check_append_input_refuses_input_that_leaves_no_room_for_a_reply,
    check_claim_of_an_unknown_run_loads_nothing,
    check_claim_takes_a_higher_token_and_refuses_an_equal_or_lower_one,
    check_claim_counts_an_attempt_only_when_the_step_has_work,
    check_save_is_fenced_and_takes_exactly_the_next_seq,
    check_save_clears_attempts_and_the_last_error,
    check_owed_run_end_hooks_give_a_finished_run_work_until_a_fenced_note,
    check_children_are_started_once_and_a_lead_waiting_on_settled_ones_is_listed,
    check_children_are_started_under_the_leads_fence_and_never_adopted,
    check_a_lead_waiting_on_children_that_are_all_gone_is_listed,
    check_a_lead_whose_child_settled_before_its_last_save_is_listed,
    check_a_lead_waiting_at_its_answer_on_a_task_that_settled_before_its_save_is_listed,
    check_a_lead_paused_on_its_childs_approval_is_not_listed_again,
    check_save_round_trips_the_whole_document,
    check_save_trims_the_drained_inbox,
    check_save_refuses_an_oversized_checkpoint_and_writes_nothing,
    check_save_refuses_a_nul_as_postgres_does,
    check_a_write_that_says_what_it_added_keeps_the_whole_run,
    check_note_usage_is_fenced_and_counted_until_the_next_write,
)
