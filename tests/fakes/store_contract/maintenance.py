"""Contract checks of deleting, pruning, agent names and forks."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import pytest

from store import errors
from store.records import Checkpoint
from tests.fakes.store_contract.subject import (
    AGENT,
    StoreFactory,
    claimed_run,
    new_run,
    save_next,
    user_message,
)

# -- maintenance -----------------------------------------------------------------------------------


def check_delete_drops_the_run_its_inbox_and_its_history(make: StoreFactory) -> None:
    store = make(50).store
    checkpoint = new_run(store, "ct-delete")
    save_next(store, checkpoint, step=1)
    store.append_input("ct-delete", AGENT, [user_message("pending")])
    assert store.delete("ct-delete") is True
    assert store.load("ct-delete") is None
    assert store.inbox("ct-delete", 0) == [] and store.history("ct-delete") == []
    assert store.delete("ct-delete") is False
    # The id starts over as a new run.
    assert store.append_input("ct-delete", AGENT, [user_message("again")]) == 1
    restarted = claimed_run(store, "ct-delete", 1)
    assert restarted.seq == 0 and restarted.messages == []


def check_a_run_deleted_with_kept_history_can_start_over(make: StoreFactory) -> None:
    store = make(50).store
    checkpoint = new_run(store, "ct-keep")
    save_next(store, checkpoint, step=1, messages=[user_message("old")])
    assert store.delete("ct-keep", keep_history=True) is True
    assert store.load("ct-keep") is None
    assert [e.checkpoint.messages[0].content for e in store.history("ct-keep")] == ["old"]

    store.append_input("ct-keep", AGENT, [user_message("new")])
    restarted = claimed_run(store, "ct-keep", 2)
    assert restarted.messages == []
    save_next(store, restarted, step=1, messages=[user_message("new")])
    assert [e.checkpoint.messages[0].content for e in store.history("ct-keep")] == ["new", "old"]
    seqs = [e.seq for e in store.history("ct-keep")]
    assert seqs == sorted(seqs, reverse=True) and len(set(seqs)) == 2


def check_prune_drops_old_finished_runs_and_old_history(make: StoreFactory) -> None:
    subject = make(50)
    store = subject.store
    old = new_run(store, "ct-prune-old")
    save_next(store, old, status="finished", inbox_cursor=1)
    live = new_run(store, "ct-prune-live")
    save_next(store, live, step=1)
    waiting = new_run(store, "ct-prune-waiting")
    save_next(store, waiting, status="finished", inbox_cursor=1)
    store.append_input("ct-prune-waiting", AGENT, [user_message("more")])
    subject.tick()
    cutoff = subject.now()
    subject.tick()
    recent = new_run(store, "ct-prune-recent")
    save_next(store, recent, status="finished", inbox_cursor=1)

    assert store.prune(cutoff) == 1
    assert store.load("ct-prune-old") is None and store.history("ct-prune-old") == []
    for kept in ("ct-prune-live", "ct-prune-waiting", "ct-prune-recent"):
        assert store.load(kept) is not None
    assert store.history("ct-prune-live") == []  # its one save is older than the cutoff
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
    checkpoint = new_run(store, "ct-prune-edge")
    checkpoint = save_next(store, checkpoint, step=1)
    subject.tick()
    cutoff = subject.now() - timedelta(microseconds=1)
    subject.tick()
    save_next(store, checkpoint, step=2, status="finished", inbox_cursor=1)
    assert store.prune(cutoff) == 0
    assert [e.seq for e in store.history("ct-prune-edge")] == [2]


# -- forks -----------------------------------------------------------------------------------------


def check_create_run_stores_a_new_run_once_with_its_queued_input(make: StoreFactory) -> None:
    store = make(50).store
    fork = Checkpoint(session_id="ct-fork", agent=AGENT, messages=[user_message("from step 1")], step=1, run_start=0)
    assert store.create_run(fork, [user_message("It will rain.")]) is True
    assert store.create_run(fork.model_copy(update={"step": 9}), []) is False
    loaded = store.load("ct-fork")
    assert loaded is not None
    assert (loaded.seq, loaded.fence, loaded.step, loaded.status) == (0, 0, 1, "in-progress")
    assert [m.content for m in loaded.messages] == ["from step 1"]
    assert [(e.n, [m.content for m in e.messages]) for e in store.inbox("ct-fork", 0)] == [(1, ["It will rain."])]
    assert store.append_input("ct-fork", AGENT, [user_message("next")]) == 2
    assert store.claim("ct-fork", 1, None).inbox_head == 2

    assert store.create_run(fork.model_copy(update={"session_id": "ct-fork-quiet"})) is True
    assert store.inbox("ct-fork-quiet", 0) == []
    assert store.append_input("ct-fork-quiet", AGENT, [user_message("first")]) == 1


def check_append_input_refuses_an_unreadable_run(make: StoreFactory) -> None:
    subject = make(50)
    checkpoint = new_run(subject.store, "ct-unreadable")
    save_next(subject.store, checkpoint, step=1)
    subject.corrupt("ct-unreadable")
    with pytest.raises(errors.CheckpointCorruptError):
        subject.store.append_input("ct-unreadable", AGENT, [user_message("more")])
    assert [e.n for e in subject.store.inbox("ct-unreadable", 0)] == [1]


CHECKS: tuple[Callable[[StoreFactory], None], ...] = (
    check_delete_drops_the_run_its_inbox_and_its_history,
    check_a_run_deleted_with_kept_history_can_start_over,
    check_prune_drops_old_finished_runs_and_old_history,
    check_registered_agents_are_known_by_name,
    check_saves_after_the_prune_cutoff_are_not_pruned,
    check_create_run_stores_a_new_run_once_with_its_queued_input,
    check_append_input_refuses_an_unreadable_run,
)
