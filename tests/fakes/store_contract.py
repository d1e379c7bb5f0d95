"""The checkpoint store contract: checks every store implementation must pass, given a factory.

The unit tier runs them against ``store.memory.MemoryCheckpointStore``; the integration tier can
run the same functions against ``PostgresCheckpointStore``, with a factory over an empty database:
``StoreSubject(store, PostgresApprovalStore(engine), now=lambda: datetime.now(UTC),
tick=lambda: time.sleep(0.01), corrupt=<an UPDATE of runs.document>)``, and
``@pytest.mark.parametrize("check", CHECKS)``. Each check owns the run ids it creates.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol

import pytest

from store import errors, payloads
from store.approvals import Decision
from store.checkpoints import Claim
from store.records import (
    Approval,
    Checkpoint,
    HistoryEntry,
    InboxEntry,
    LastError,
    Message,
    PendingRun,
    ToolCall,
    Usage,
)


class CheckpointStore(Protocol):
    """The methods the step, the producer and the sweep use."""

    history_limit: int

    def claim(self, session_id: str, token: int, seq: int | None) -> Claim: ...
    def inbox(self, session_id: str, cursor: int) -> list[InboxEntry]: ...
    def save(self, checkpoint: Checkpoint, *, drained_inbox: bool = False,
             approvals: Sequence[Approval] = ()) -> datetime | None: ...
    def refuse(self, session_id: str, fence: int, error: LastError, approval_ids: Sequence[str]) -> bool: ...
    def decisions(self, approval_ids: Sequence[str]) -> dict[str, Approval]: ...
    def record_failure(self, session_id: str, fence: int, error: LastError) -> int | None: ...
    def append_input(self, session_id: str, agent: str, messages: Sequence[Message]) -> int: ...
    def create_run(self, checkpoint: Checkpoint, queued: Sequence[Message] = ()) -> bool: ...
    def reset_attempts(self, session_id: str) -> int | None: ...
    def load(self, session_id: str) -> Checkpoint | None: ...
    def list(self, *, statuses: Iterable[str] | None = None, agent: str | None = None,
             limit: int = 1000) -> builtins.list[Checkpoint | PendingRun]: ...
    def history(self, session_id: str, limit: int | None = None) -> builtins.list[HistoryEntry]: ...
    def stale_runs(self, stale_after_s: float, limit: int = 500) -> builtins.list[tuple[str, int]]: ...
    def delete(self, session_id: str, *, keep_history: bool = False) -> bool: ...
    def prune(self, older_than: datetime) -> int: ...
    def register_agents(self, fingerprints: dict[str, dict[str, Any]]) -> None: ...
    def known_agents(self) -> builtins.list[str]: ...


class ApprovalStore(Protocol):
    """Reads and decisions on the approvals that pausing saves create."""

    def by_ids(self, approval_ids: Sequence[str]) -> dict[str, Approval]: ...
    def pending(self, agent: str | None = None, limit: int = 1000) -> builtins.list[Approval]: ...
    def resolve(self, approval_id: str, approved: bool, note: str | None = None) -> Decision: ...


@dataclass
class StoreSubject:
    """A store under test and the few things the contract cannot do through the store itself."""

    store: CheckpointStore
    #: The approval store over the same data.
    approvals: ApprovalStore
    #: The store's notion of now (Postgres ``now()``, or the fake clock).
    now: Callable[[], datetime]
    #: Make every later write carry a strictly later timestamp than every earlier one.
    tick: Callable[[], object]
    #: Overwrite a run's stored document with one that does not parse as a checkpoint.
    corrupt: Callable[[str], None]


#: Builds a subject over an empty store with the given history ring size.
StoreFactory = Callable[[int], StoreSubject]

AGENT = "contract-agent"


def _user(text: str) -> Message:
    return Message(role="user", content=text)


def _claimed(store: CheckpointStore, session_id: str, token: int, seq: int | None = None) -> Checkpoint:
    claim = store.claim(session_id, token, seq)
    assert claim.checkpoint is not None, f"claim of {session_id} with token {token} refused: {claim}"
    return claim.checkpoint


def _saved(store: CheckpointStore, checkpoint: Checkpoint, **update: Any) -> Checkpoint:
    """Save ``checkpoint`` as the next seq with ``update`` applied; it must be accepted."""
    new = checkpoint.model_copy(update={"seq": checkpoint.seq + 1, **update})
    drained = new.inbox_cursor != checkpoint.inbox_cursor
    assert store.save(new, drained_inbox=drained) is not None, f"save of seq {new.seq} refused"
    return new


def _new_run(store: CheckpointStore, session_id: str, text: str = "hello") -> Checkpoint:
    store.append_input(session_id, AGENT, [_user(text)])
    return _claimed(store, session_id, 1)


def _comparable(checkpoint: Checkpoint) -> dict[str, Any]:
    return checkpoint.model_dump(mode="json", exclude={"updated_at", "attempts", "last_error", "inbox_cursor",
                                                       "history_seq"})


# -- inbox -------------------------------------------------------------------------------------


def check_append_input_creates_the_run_and_numbers_input_per_run(make: StoreFactory) -> None:
    store = make(50).store
    assert store.append_input("ct-inbox-a", AGENT, [_user("one")]) == 1
    assert store.append_input("ct-inbox-a", AGENT, [_user("two"), _user("three")]) == 2
    assert store.append_input("ct-inbox-b", AGENT, [_user("other")]) == 1

    created = store.load("ct-inbox-a")
    assert created is not None
    assert (created.agent, created.status, created.seq, created.fence, created.attempts) == (
        AGENT, "in-progress", 0, 0, 0)
    assert created.messages == [] and created.inbox_cursor == 0 and created.last_error is None
    assert created.updated_at is not None and created.updated_at.tzinfo is not None
    entries = store.inbox("ct-inbox-a", 0)
    assert [e.n for e in entries] == [1, 2]
    assert [[m.content for m in e.messages] for e in entries] == [["one"], ["two", "three"]]
    assert [e.n for e in store.inbox("ct-inbox-a", 1)] == [2]
    assert store.inbox("ct-inbox-unknown", 0) == []


def check_append_input_refuses_a_session_of_another_agent(make: StoreFactory) -> None:
    store = make(50).store
    store.append_input("ct-agent", AGENT, [_user("mine")])
    with pytest.raises(errors.ConfigurationError):
        store.append_input("ct-agent", "someone-else", [_user("theirs")])
    assert [e.n for e in store.inbox("ct-agent", 0)] == [1]
    loaded = store.load("ct-agent")
    assert loaded is not None and loaded.agent == AGENT


def check_append_input_refuses_a_run_awaiting_approval(make: StoreFactory) -> None:
    store = make(50).store
    checkpoint = _new_run(store, "ct-paused")
    _saved(store, checkpoint, status="awaiting-approval", approval_ids=["ap-1", "ap-2"], inbox_cursor=1)
    with pytest.raises(errors.SessionAwaitingApprovalError) as raised:
        store.append_input("ct-paused", AGENT, [_user("are you done?")])
    assert raised.value.fields == {"session_id": "ct-paused", "approval_id": "ap-1"}
    assert store.inbox("ct-paused", 0) == []


# -- claim -------------------------------------------------------------------------------------


def check_claim_of_an_unknown_run_loads_nothing(make: StoreFactory) -> None:
    store = make(50).store
    assert store.claim("ct-nobody", 7, None) == Claim(None, stored_fence=None)


def check_claim_takes_a_higher_token_and_refuses_an_equal_or_lower_one(make: StoreFactory) -> None:
    store = make(50).store
    store.append_input("ct-claim", AGENT, [_user("hi")])
    claim = store.claim("ct-claim", 5, None)
    assert claim.checkpoint is not None and claim.checkpoint.fence == 5 and claim.inbox_head == 1
    assert store.claim("ct-claim", 5, None) == Claim(None, stored_fence=5)
    assert store.claim("ct-claim", 3, None) == Claim(None, stored_fence=5)
    assert _claimed(store, "ct-claim", 6).fence == 6
    loaded = store.load("ct-claim")
    assert loaded is not None and loaded.fence == 6


def check_claim_counts_an_attempt_only_when_the_step_has_work(make: StoreFactory) -> None:
    store = make(50).store
    store.append_input("ct-attempts", AGENT, [_user("hi")])
    assert _claimed(store, "ct-attempts", 1).attempts == 1          # in progress, no seq given
    assert _claimed(store, "ct-attempts", 2, seq=0).attempts == 2   # in progress, matching seq
    current = _claimed(store, "ct-attempts", 3, seq=9)               # a stale message: no attempt
    assert current.attempts == 2

    _saved(store, current, status="finished", inbox_cursor=1)
    assert _claimed(store, "ct-attempts", 4).attempts == 0          # finished, nothing new to do
    store.append_input("ct-attempts", AGENT, [_user("more")])
    assert _claimed(store, "ct-attempts", 5).attempts == 1          # finished with new input


# -- save ---------------------------------------------------------------------------------------


def check_save_is_fenced_and_takes_exactly_the_next_seq(make: StoreFactory) -> None:
    store = make(50).store
    first = _new_run(store, "ct-save")
    saved_at = store.save(first.model_copy(update={"seq": 1, "step": 1}))
    assert saved_at is not None and saved_at.tzinfo is not None
    assert store.save(first.model_copy(update={"seq": 1, "step": 2})) is None   # same seq twice
    assert store.save(first.model_copy(update={"seq": 3, "step": 3})) is None   # a gap

    second = _claimed(store, "ct-save", 2)
    # The first holder's token was replaced: its save is refused before the new holder saved.
    assert store.save(first.model_copy(update={"seq": 2, "step": 99})) is None
    loaded = store.load("ct-save")
    assert loaded is not None and (loaded.seq, loaded.step, loaded.fence) == (1, 1, 2)
    assert store.save(second.model_copy(update={"seq": 2, "step": 2})) is not None
    assert [(e.seq, e.checkpoint.fence) for e in store.history("ct-save")] == [(2, 2), (1, 1)]


def check_save_clears_attempts_and_the_last_error(make: StoreFactory) -> None:
    store = make(50).store
    checkpoint = _new_run(store, "ct-clear")
    assert store.record_failure("ct-clear", checkpoint.fence, LastError(code="X", message="boom", retryable=True)) == 1
    failed = store.load("ct-clear")
    assert failed is not None and failed.last_error == LastError(code="X", message="boom", retryable=True)
    _saved(store, checkpoint, step=1)
    loaded = store.load("ct-clear")
    assert loaded is not None and loaded.attempts == 0 and loaded.last_error is None


def check_save_round_trips_the_whole_document(make: StoreFactory) -> None:
    store = make(50).store
    checkpoint = _new_run(store, "ct-doc")
    call = ToolCall(id="call-1", name="charge", args={"amount": 5.5, "tags": ["a", "b"], "meta": {"n": 10**30}})
    messages = [
        Message(role="system", content="be brief"),
        Message(role="user", content="100% _sure_ '; DROP TABLE runs; -- \u65e5\u672c \U0001f680 \\u0000 \"q\""),
        Message(role="assistant", content=None, tool_calls=[call]),
        Message(role="tool", tool_call_id="call-1", name="charge", content='{"error": "no"}', is_error=True),
        Message(role="assistant", content="done"),
    ]
    saved = _saved(store, checkpoint, messages=messages, step=2, status="finished", finish_reason="stop",
                   usage=Usage(input_tokens=3, output_tokens=4, total_tokens=7), run_start=1,
                   business_state={"cart": [1, 2, {"x": None}], "flag": True, "ratio": 0.25},
                   fingerprint={"hash": "abc"}, started_tool_call_ids=["call-1"], inbox_cursor=1)
    loaded = store.load("ct-doc")
    assert loaded is not None
    assert _comparable(loaded) == _comparable(saved)
    assert loaded.inbox_cursor == 1
    (entry,) = store.history("ct-doc")
    assert _comparable(entry.checkpoint) == _comparable(saved)


def check_save_trims_the_drained_inbox(make: StoreFactory) -> None:
    store = make(50).store
    checkpoint = _new_run(store, "ct-drain")
    store.append_input("ct-drain", AGENT, [_user("two")])
    store.append_input("ct-drain", AGENT, [_user("three")])
    kept = checkpoint.model_copy(update={"seq": 1, "inbox_cursor": 1})
    assert store.save(kept) is not None
    assert [e.n for e in store.inbox("ct-drain", 0)] == [1, 2, 3]      # not drained: kept
    drained = kept.model_copy(update={"seq": 2, "inbox_cursor": 2})
    assert store.save(drained, drained_inbox=True) is not None
    assert [e.n for e in store.inbox("ct-drain", 0)] == [3]
    loaded = store.load("ct-drain")
    assert loaded is not None and loaded.inbox_cursor == 2


def check_save_refuses_an_oversized_checkpoint_and_writes_nothing(make: StoreFactory) -> None:
    store = make(50).store
    checkpoint = _new_run(store, "ct-huge")
    huge = checkpoint.model_copy(update={"seq": 1, "messages": [_user("x" * (payloads.MAX_CHECKPOINT + 1))]})
    with pytest.raises(errors.InputTooLargeError):
        store.save(huge)
    loaded = store.load("ct-huge")
    assert loaded is not None and loaded.seq == 0 and store.history("ct-huge") == []


def check_save_refuses_a_nul_as_postgres_does(make: StoreFactory) -> None:
    store = make(50).store
    checkpoint = _new_run(store, "ct-nul")
    with pytest.raises(errors.StorageError):
        store.save(checkpoint.model_copy(update={"seq": 1, "business_state": {"k": "a\x00b"}}))
    loaded = store.load("ct-nul")
    assert loaded is not None and loaded.seq == 0 and store.history("ct-nul") == []


# -- history -------------------------------------------------------------------------------------


def check_history_is_newest_first_and_keeps_a_ring(make: StoreFactory) -> None:
    store = make(3).store
    checkpoint = _new_run(store, "ct-ring")
    for step in range(1, 6):
        checkpoint = _saved(store, checkpoint, step=step, messages=[_user(f"m{step}")],
                            status="finished" if step == 5 else "in-progress")
    entries = store.history("ct-ring")
    assert [e.seq for e in entries] == [5, 4, 3]
    assert [e.step for e in entries] == [5, 4, 3]
    assert [e.status for e in entries] == ["finished", "in-progress", "in-progress"]
    assert [e.checkpoint.messages[0].content for e in entries] == ["m5", "m4", "m3"]
    assert all(e.checkpoint.session_id == "ct-ring" and e.checkpoint.agent == AGENT for e in entries)
    assert all(e.saved_at.tzinfo is not None and e.checkpoint.seq == e.seq for e in entries)
    assert entries[0].saved_at >= entries[-1].saved_at
    assert [e.seq for e in store.history("ct-ring", limit=2)] == [5, 4]
    assert store.history("ct-never-saved") == []


def check_history_rebuilds_every_kept_state_of_a_long_run(make: StoreFactory) -> None:
    store = make(20).store
    checkpoint = _new_run(store, "ct-long")
    transcripts: dict[int, list[str]] = {}
    texts: list[str] = []
    for step in range(1, 41):
        # The transcript grows at its tail, except once when it is rewritten from the middle (a patch).
        texts = [*texts[:3], "rewritten"] if step == 25 else [*texts, f"m{step}"]
        checkpoint = _saved(store, checkpoint, step=step, messages=[_user(t) for t in texts])
        transcripts[checkpoint.seq] = list(texts)
    entries = store.history("ct-long")
    assert [e.seq for e in entries] == list(range(40, 20, -1))
    for entry in entries:
        assert [m.content for m in entry.checkpoint.messages] == transcripts[entry.seq], f"seq {entry.seq}"
    assert [e.seq for e in store.history("ct-long", limit=3)] == [40, 39, 38]


def check_history_limit_zero_keeps_no_history(make: StoreFactory) -> None:
    store = make(0).store
    checkpoint = _new_run(store, "ct-no-ring")
    _saved(store, checkpoint, step=1)
    assert store.history("ct-no-ring") == []


# -- failures and parking ------------------------------------------------------------------------


def check_record_failure_is_fenced(make: StoreFactory) -> None:
    store = make(50).store
    first = _new_run(store, "ct-fail")
    _claimed(store, "ct-fail", 2)
    error = LastError(code="LOUSHO_PROVIDER_REQUEST_FAILED", message="503", retryable=True)
    assert store.record_failure("ct-fail", first.fence, error) is None
    loaded = store.load("ct-fail")
    assert loaded is not None and loaded.last_error is None
    assert store.record_failure("ct-fail", 2, error) == 2
    loaded = store.load("ct-fail")
    assert loaded is not None and loaded.last_error == error and loaded.attempts == 2


def check_reset_attempts_clears_a_parked_run_only_while_in_progress(make: StoreFactory) -> None:
    store = make(50).store
    parked = _new_run(store, "ct-parked")
    parked = _saved(store, parked, step=1)
    _claimed(store, "ct-parked", 2)
    store.record_failure("ct-parked", 2, LastError(code="X", retryable=False))
    assert store.reset_attempts("ct-parked") == 1
    loaded = store.load("ct-parked")
    assert loaded is not None and loaded.attempts == 0 and loaded.last_error is None

    done = _new_run(store, "ct-done")
    _saved(store, done, status="finished", inbox_cursor=1)
    assert store.reset_attempts("ct-done") is None
    assert store.reset_attempts("ct-nobody") is None


# -- listing ---------------------------------------------------------------------------------------


def check_list_filters_and_orders_by_creation(make: StoreFactory) -> None:
    subject = make(50)
    store = subject.store
    store.append_input("ct-list-z", AGENT, [_user("first created")])
    subject.tick()
    store.append_input("ct-list-a", AGENT, [_user("second created")])
    store.append_input("ct-list-other", "other-agent", [_user("another agent")])
    finished = _claimed(store, "ct-list-a", 1)
    _saved(store, finished, status="finished", inbox_cursor=1)

    ours = {"ct-list-z", "ct-list-a", "ct-list-other"}

    def listed(**kwargs: Any) -> list[str]:
        return [c.session_id for c in store.list(**kwargs) if c.session_id in ours]

    assert listed() == ["ct-list-z", "ct-list-a", "ct-list-other"]
    assert listed(statuses=["in-progress"]) == ["ct-list-z", "ct-list-other"]
    assert listed(statuses=["finished"], agent=AGENT) == ["ct-list-a"]
    assert listed(agent="other-agent") == ["ct-list-other"]
    assert listed(statuses=[]) == []
    assert len(store.list(limit=1)) == 1


def check_an_unreadable_checkpoint_is_listed_as_corrupt(make: StoreFactory) -> None:
    subject = make(50)
    store = subject.store
    store.append_input("ct-corrupt", AGENT, [_user("hi")])
    subject.corrupt("ct-corrupt")
    (entry,) = [c for c in store.list() if c.session_id == "ct-corrupt"]
    assert isinstance(entry, PendingRun)
    assert entry.last_error is not None and entry.last_error.code == "LOUSHO_CHECKPOINT_CORRUPT"
    assert entry.last_error.retryable is False and entry.agent == AGENT
    with pytest.raises(errors.CheckpointCorruptError):
        store.load("ct-corrupt")


def check_stale_runs_are_those_that_should_be_moving(make: StoreFactory) -> None:
    subject = make(50)
    store = subject.store
    moving = _new_run(store, "ct-stale-moving")
    _saved(store, moving, step=1)
    subject.tick()
    retrying = _new_run(store, "ct-stale-retrying")
    store.record_failure("ct-stale-retrying", retrying.fence, LastError(code="X", retryable=True))
    parked = _new_run(store, "ct-stale-parked")
    store.record_failure("ct-stale-parked", parked.fence, LastError(code="X", retryable=False))
    done = _new_run(store, "ct-stale-done")
    _saved(store, done, status="finished", inbox_cursor=1)
    waiting = _new_run(store, "ct-stale-waiting")
    _saved(store, waiting, status="finished", inbox_cursor=1)
    store.append_input("ct-stale-waiting", AGENT, [_user("one more")])
    subject.tick()

    ours = {"ct-stale-moving", "ct-stale-retrying", "ct-stale-parked", "ct-stale-done", "ct-stale-waiting"}
    stale = [(sid, seq) for sid, seq in store.stale_runs(0) if sid in ours]
    assert stale[0] == ("ct-stale-moving", 1)     # oldest update first
    assert sorted(stale[1:]) == [("ct-stale-retrying", 0), ("ct-stale-waiting", 1)]
    assert [sid for sid, _ in store.stale_runs(3600) if sid in ours] == []
    assert len(store.stale_runs(0, limit=1)) == 1


# -- maintenance -----------------------------------------------------------------------------------


def check_delete_drops_the_run_its_inbox_and_its_history(make: StoreFactory) -> None:
    store = make(50).store
    checkpoint = _new_run(store, "ct-delete")
    _saved(store, checkpoint, step=1)
    store.append_input("ct-delete", AGENT, [_user("pending")])
    assert store.delete("ct-delete") is True
    assert store.load("ct-delete") is None
    assert store.inbox("ct-delete", 0) == [] and store.history("ct-delete") == []
    assert store.delete("ct-delete") is False
    # The id starts over as a new run.
    assert store.append_input("ct-delete", AGENT, [_user("again")]) == 1
    restarted = _claimed(store, "ct-delete", 1)
    assert restarted.seq == 0 and restarted.messages == []


def check_a_run_deleted_with_kept_history_can_start_over(make: StoreFactory) -> None:
    store = make(50).store
    checkpoint = _new_run(store, "ct-keep")
    _saved(store, checkpoint, step=1, messages=[_user("old")])
    assert store.delete("ct-keep", keep_history=True) is True
    assert store.load("ct-keep") is None
    assert [e.checkpoint.messages[0].content for e in store.history("ct-keep")] == ["old"]

    store.append_input("ct-keep", AGENT, [_user("new")])
    restarted = _claimed(store, "ct-keep", 2)
    assert restarted.messages == []
    _saved(store, restarted, step=1, messages=[_user("new")])
    assert [e.checkpoint.messages[0].content for e in store.history("ct-keep")] == ["new", "old"]
    seqs = [e.seq for e in store.history("ct-keep")]
    assert seqs == sorted(seqs, reverse=True) and len(set(seqs)) == 2


def check_prune_drops_old_finished_runs_and_old_history(make: StoreFactory) -> None:
    subject = make(50)
    store = subject.store
    old = _new_run(store, "ct-prune-old")
    _saved(store, old, status="finished", inbox_cursor=1)
    live = _new_run(store, "ct-prune-live")
    _saved(store, live, step=1)
    waiting = _new_run(store, "ct-prune-waiting")
    _saved(store, waiting, status="finished", inbox_cursor=1)
    store.append_input("ct-prune-waiting", AGENT, [_user("more")])
    subject.tick()
    cutoff = subject.now()
    subject.tick()
    recent = _new_run(store, "ct-prune-recent")
    _saved(store, recent, status="finished", inbox_cursor=1)

    assert store.prune(cutoff) == 1
    assert store.load("ct-prune-old") is None and store.history("ct-prune-old") == []
    for kept in ("ct-prune-live", "ct-prune-waiting", "ct-prune-recent"):
        assert store.load(kept) is not None
    assert store.history("ct-prune-live") == []          # its one save is older than the cutoff
    assert [e.seq for e in store.history("ct-prune-recent")] == [1]
    with pytest.raises(errors.ConfigurationError):
        store.prune(cutoff.replace(tzinfo=None))


def check_registered_agents_are_known_by_name(make: StoreFactory) -> None:
    store = make(50).store
    store.register_agents({})
    store.register_agents({"ct-b": {"hash": "1"}, "ct-a": {"hash": "2"}})
    store.register_agents({"ct-b": {"hash": "3"}})
    assert [name for name in store.known_agents() if name.startswith("ct-")] == ["ct-a", "ct-b"]


def check_saves_after_the_prune_cutoff_are_not_pruned(make: StoreFactory) -> None:
    subject = make(50)
    store = subject.store
    checkpoint = _new_run(store, "ct-prune-edge")
    checkpoint = _saved(store, checkpoint, step=1)
    subject.tick()
    cutoff = subject.now() - timedelta(microseconds=1)
    subject.tick()
    _saved(store, checkpoint, step=2, status="finished", inbox_cursor=1)
    assert store.prune(cutoff) == 0
    assert [e.seq for e in store.history("ct-prune-edge")] == [2]


# -- forks -----------------------------------------------------------------------------------------


def check_create_run_stores_a_new_run_once_with_its_queued_input(make: StoreFactory) -> None:
    store = make(50).store
    fork = Checkpoint(session_id="ct-fork", agent=AGENT, messages=[_user("from step 1")], step=1, run_start=0)
    assert store.create_run(fork, [_user("It will rain.")]) is True
    assert store.create_run(fork.model_copy(update={"step": 9}), []) is False
    loaded = store.load("ct-fork")
    assert loaded is not None
    assert (loaded.seq, loaded.fence, loaded.step, loaded.status) == (0, 0, 1, "in-progress")
    assert [m.content for m in loaded.messages] == ["from step 1"]
    assert [(e.n, [m.content for m in e.messages]) for e in store.inbox("ct-fork", 0)] == [(1, ["It will rain."])]
    assert store.append_input("ct-fork", AGENT, [_user("next")]) == 2
    assert store.claim("ct-fork", 1, None).inbox_head == 2

    assert store.create_run(fork.model_copy(update={"session_id": "ct-fork-quiet"})) is True
    assert store.inbox("ct-fork-quiet", 0) == []
    assert store.append_input("ct-fork-quiet", AGENT, [_user("first")]) == 1


def check_append_input_refuses_an_unreadable_run(make: StoreFactory) -> None:
    subject = make(50)
    checkpoint = _new_run(subject.store, "ct-unreadable")
    _saved(subject.store, checkpoint, step=1)
    subject.corrupt("ct-unreadable")
    with pytest.raises(errors.CheckpointCorruptError):
        subject.store.append_input("ct-unreadable", AGENT, [_user("more")])
    assert [e.n for e in subject.store.inbox("ct-unreadable", 0)] == [1]


# -- approvals ---------------------------------------------------------------------------------------


def _paused(store: CheckpointStore, session_id: str, calls: int = 2) -> tuple[Checkpoint, list[Approval]]:
    """A run whose turn asked for ``calls`` gated calls, saved paused on one approval each."""
    checkpoint = _new_run(store, session_id)
    turn = [ToolCall(id=f"{session_id}-c{k}", name="email", args={"to": f"t{k}", "n": 10**30}) for k in range(calls)]
    approvals = [Approval(approval_id=f"{session_id}-ap{k}", session_id=session_id, tool_call_id=call.id,
                          tool_name=call.name, args=call.args, agent=AGENT) for k, call in enumerate(turn)]
    paused = checkpoint.model_copy(update={
        "seq": 1, "messages": [_user("email them"), Message(role="assistant", tool_calls=turn)], "step": 1,
        "status": "awaiting-approval", "approval_ids": [a.approval_id for a in approvals], "inbox_cursor": 1})
    assert store.save(paused, drained_inbox=True, approvals=approvals) is not None
    return paused, approvals


def check_a_pausing_save_creates_one_pending_approval_per_gated_call(make: StoreFactory) -> None:
    subject = make(50)
    _, approvals = _paused(subject.store, "ct-pause")
    found = subject.store.decisions([a.approval_id for a in approvals] + ["ct-pause-unknown"])
    assert sorted(found) == ["ct-pause-ap0", "ct-pause-ap1"]
    first = found["ct-pause-ap0"]
    assert (first.status, first.session_id, first.tool_call_id, first.tool_name) == (
        "pending", "ct-pause", "ct-pause-c0", "email")
    assert first.args == {"to": "t0", "n": 10**30} and first.created_at is not None
    listed = [a.approval_id for a in subject.approvals.pending(AGENT) if a.session_id == "ct-pause"]
    assert listed == ["ct-pause-ap0", "ct-pause-ap1"]
    assert [a for a in subject.approvals.pending("another-agent") if a.session_id == "ct-pause"] == []
    assert subject.store.decisions([]) == {}


def check_the_last_decision_of_a_pause_lets_the_run_continue(make: StoreFactory) -> None:
    subject = make(50)
    _paused(subject.store, "ct-decide")
    first = subject.approvals.resolve("ct-decide-ap0", approved=True, note="ok\x00")
    assert first.run_continues is False and first.approval.status == "approved"
    loaded = subject.store.load("ct-decide")
    assert loaded is not None and loaded.status == "awaiting-approval"
    second = subject.approvals.resolve("ct-decide-ap1", approved=False, note="not this one")
    assert second.run_continues is True and second.approval.status == "rejected"
    loaded = subject.store.load("ct-decide")
    assert loaded is not None and (loaded.status, loaded.attempts, loaded.last_error) == ("in-progress", 0, None)
    decided = subject.store.decisions(["ct-decide-ap0", "ct-decide-ap1"])
    assert (decided["ct-decide-ap0"].status, decided["ct-decide-ap0"].note) == ("approved", "ok\ufffd")
    assert (decided["ct-decide-ap1"].status, decided["ct-decide-ap1"].note) == ("rejected", "not this one")
    assert decided["ct-decide-ap1"].decided_at is not None
    with pytest.raises(errors.ApprovalNotFoundError):
        subject.approvals.resolve("ct-decide-ap0", approved=True)
    with pytest.raises(errors.ApprovalNotFoundError):
        subject.approvals.resolve("ct-decide-unknown", approved=True)


def check_an_approval_of_a_deleted_run_is_withdrawn_and_orphaned(make: StoreFactory) -> None:
    subject = make(50)
    _paused(subject.store, "ct-orphan")
    assert subject.store.delete("ct-orphan")
    assert subject.store.decisions(["ct-orphan-ap0"])["ct-orphan-ap0"].status == "withdrawn"
    for _ in range(2):
        with pytest.raises(errors.ApprovalOrphanedError):
            subject.approvals.resolve("ct-orphan-ap0", approved=True)
    assert [a for a in subject.approvals.pending() if a.session_id == "ct-orphan"] == []


def check_an_approval_the_run_no_longer_waits_on_is_withdrawn_when_resolved(make: StoreFactory) -> None:
    subject = make(50)
    paused, _ = _paused(subject.store, "ct-replaced")
    # The run moved on without this decision (a fork of an older step, a refusal...): it is stale.
    moved = _claimed(subject.store, "ct-replaced", 2)
    _saved(subject.store, moved, status="in-progress", approval_ids=[])
    with pytest.raises(errors.ApprovalOrphanedError):
        subject.approvals.resolve("ct-replaced-ap0", approved=True)
    assert subject.store.decisions(["ct-replaced-ap0"])["ct-replaced-ap0"].status == "withdrawn"
    loaded = subject.store.load("ct-replaced")
    assert loaded is not None and loaded.status == "in-progress" and loaded.seq == paused.seq + 1


def check_refuse_parks_the_run_and_puts_its_decisions_back(make: StoreFactory) -> None:
    subject = make(50)
    paused, approvals = _paused(subject.store, "ct-refuse", calls=1)
    subject.approvals.resolve("ct-refuse-ap0", approved=True)
    holder = _claimed(subject.store, "ct-refuse", 2)
    error = LastError(code="LOUSHO_AGENT_DRIFT", message="tools changed", retryable=True)
    assert subject.store.refuse("ct-refuse", 1, error, ["ct-refuse-ap0"]) is False      # fenced out
    assert subject.store.refuse("ct-refuse", holder.fence, error, ["ct-refuse-ap0"]) is True
    loaded = subject.store.load("ct-refuse")
    assert loaded is not None
    assert loaded.last_error == error.model_copy(update={"retryable": False})
    assert loaded.status == "awaiting-approval" and _comparable(loaded) == _comparable(
        paused.model_copy(update={"fence": holder.fence}))
    back = subject.store.decisions(["ct-refuse-ap0"])["ct-refuse-ap0"]
    assert (back.status, back.note, back.decided_at) == ("pending", None, None)
    assert [a.approval_id for a in approvals] == ["ct-refuse-ap0"]


CHECKS: tuple[Callable[[StoreFactory], None], ...] = (
    check_append_input_creates_the_run_and_numbers_input_per_run,
    check_append_input_refuses_a_session_of_another_agent,
    check_append_input_refuses_a_run_awaiting_approval,
    check_claim_of_an_unknown_run_loads_nothing,
    check_claim_takes_a_higher_token_and_refuses_an_equal_or_lower_one,
    check_claim_counts_an_attempt_only_when_the_step_has_work,
    check_save_is_fenced_and_takes_exactly_the_next_seq,
    check_save_clears_attempts_and_the_last_error,
    check_save_round_trips_the_whole_document,
    check_save_trims_the_drained_inbox,
    check_save_refuses_an_oversized_checkpoint_and_writes_nothing,
    check_save_refuses_a_nul_as_postgres_does,
    check_history_is_newest_first_and_keeps_a_ring,
    check_history_rebuilds_every_kept_state_of_a_long_run,
    check_history_limit_zero_keeps_no_history,
    check_record_failure_is_fenced,
    check_reset_attempts_clears_a_parked_run_only_while_in_progress,
    check_list_filters_and_orders_by_creation,
    check_an_unreadable_checkpoint_is_listed_as_corrupt,
    check_stale_runs_are_those_that_should_be_moving,
    check_delete_drops_the_run_its_inbox_and_its_history,
    check_a_run_deleted_with_kept_history_can_start_over,
    check_prune_drops_old_finished_runs_and_old_history,
    check_saves_after_the_prune_cutoff_are_not_pruned,
    check_registered_agents_are_known_by_name,
    check_create_run_stores_a_new_run_once_with_its_queued_input,
    check_append_input_refuses_an_unreadable_run,
    check_a_pausing_save_creates_one_pending_approval_per_gated_call,
    check_the_last_decision_of_a_pause_lets_the_run_continue,
    check_an_approval_of_a_deleted_run_is_withdrawn_and_orphaned,
    check_an_approval_the_run_no_longer_waits_on_is_withdrawn_when_resolved,
    check_refuse_parks_the_run_and_puts_its_decisions_back,
)
