"""The Postgres checkpoint store and Redis leases on the real services: fencing, history, pruning."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import psycopg
import pytest
import redis

from store import errors
from store.checkpoints import PostgresCheckpointStore
from store.leases import LeaseManager
from store.records import Checkpoint, Message
from store.settings import Settings
from tests.support import services


def _new_run(store: PostgresCheckpointStore, sid: str = "run-1") -> None:
    store.append_input(sid, "shop", [Message(role="user", content="hello")])


def _claimed(store: PostgresCheckpointStore, leases: LeaseManager, sid: str = "run-1") -> Checkpoint:
    lease = leases.acquire(sid)
    assert lease is not None
    claim = store.claim(sid, lease.token, None)
    assert claim.checkpoint is not None
    return claim.checkpoint


def test_fenced_save_accepts_the_holder_and_refuses_a_stale_token(
    store: PostgresCheckpointStore, leases: LeaseManager, redis_client: redis.Redis
) -> None:
    _new_run(store)
    old = _claimed(store, leases)
    assert store.save(old.model_copy(update={"seq": 1, "step": 1})) is not None
    # The lease expires (the old holder stalled) and a new holder claims a higher token.
    redis_client.delete("lousho:lease:run-1")
    new = _claimed(store, leases)
    assert new.fence > old.fence
    # The stalled holder's next save is refused even before the new holder saved anything.
    assert store.save(old.model_copy(update={"seq": 2, "step": 99})) is None
    assert store.load("run-1").step == 1  # type: ignore[union-attr]
    assert store.save(new.model_copy(update={"seq": 2, "step": 2})) is not None
    assert [e.checkpoint.fence for e in reversed(store.history("run-1"))] == [old.fence, new.fence]


def test_a_claim_with_a_lower_token_than_stored_is_refused(
    store: PostgresCheckpointStore, leases: LeaseManager, redis_client: redis.Redis
) -> None:
    _new_run(store)
    first = _claimed(store, leases)
    redis_client.delete("lousho:lease:run-1")
    second = _claimed(store, leases)
    claim = store.claim("run-1", first.fence, None)
    assert claim.checkpoint is None and claim.stored_fence == second.fence


def test_redis_losing_every_key_neither_blocks_the_run_nor_lets_an_old_token_win(
    store: PostgresCheckpointStore, leases: LeaseManager, redis_client: redis.Redis
) -> None:
    _new_run(store)
    for _ in range(3):
        _claimed(store, leases)
        redis_client.delete("lousho:lease:run-1")
    stored = store.load("run-1").fence  # type: ignore[union-attr]
    redis_client.flushdb()
    lease = leases.acquire("run-1")
    assert lease is not None and lease.token <= stored  # the counter restarted
    claim = store.claim("run-1", lease.token, None)
    assert claim.checkpoint is None and claim.stored_fence == stored
    assert leases.raise_token(lease, stored)
    assert lease.token > stored
    assert store.claim("run-1", lease.token, None).checkpoint is not None


def test_history_keeps_a_ring_of_the_newest_saves(
    settings: Settings, store: PostgresCheckpointStore, leases: LeaseManager
) -> None:
    ring = PostgresCheckpointStore(store.engine, history_limit=3)
    _new_run(ring)
    checkpoint = _claimed(ring, leases)
    for seq in range(1, 8):
        checkpoint = checkpoint.model_copy(update={"seq": seq, "step": seq})
        assert ring.save(checkpoint) is not None
    entries = ring.history("run-1")
    assert [e.seq for e in entries] == [7, 6, 5]
    assert [e.step for e in ring.history("run-1", limit=2)] == [7, 6]
    assert ring.history("unknown-run") == []


def test_history_limit_zero_keeps_none(store: PostgresCheckpointStore, leases: LeaseManager) -> None:
    none_kept = PostgresCheckpointStore(store.engine, history_limit=0)
    _new_run(none_kept)
    checkpoint = _claimed(none_kept, leases)
    assert none_kept.save(checkpoint.model_copy(update={"seq": 1})) is not None
    assert none_kept.history("run-1") == []


def test_delete_can_keep_the_history(store: PostgresCheckpointStore, leases: LeaseManager) -> None:
    _new_run(store)
    checkpoint = _claimed(store, leases)
    store.save(checkpoint.model_copy(update={"seq": 1}))
    assert store.delete("run-1", keep_history=True)
    assert store.load("run-1") is None
    assert len(store.history("run-1")) == 1
    _new_run(store, "run-2")
    store.delete("run-2")
    assert store.history("run-2") == []


def test_prune_drops_old_finished_runs_and_old_history(store: PostgresCheckpointStore, leases: LeaseManager) -> None:
    _new_run(store)
    checkpoint = _claimed(store, leases)
    store.save(checkpoint.model_copy(update={"seq": 1, "status": "finished", "inbox_cursor": 1}))
    _new_run(store, "run-2")
    assert store.prune(datetime.now(UTC) + timedelta(seconds=5)) == 1
    assert store.load("run-1") is None and store.load("run-2") is not None
    assert store.history("run-1") == []
    with pytest.raises(errors.ConfigurationError):
        store.prune(datetime.now())  # naive datetimes are refused


def test_list_filters_by_status_and_reports_corrupt_checkpoints(
    store: PostgresCheckpointStore, leases: LeaseManager
) -> None:
    _new_run(store, "run-a")
    _new_run(store, "run-b")
    checkpoint = _claimed(store, leases, "run-b")
    store.save(checkpoint.model_copy(update={"seq": 1, "status": "finished"}))
    assert [c.session_id for c in store.list(statuses=["in-progress"])] == ["run-a"]
    with psycopg.connect(services.test_database_url(), autocommit=True) as conn:
        conn.execute("""UPDATE runs SET document = '{"messages": "not a list"}' WHERE session_id = 'run-a'""")
    (corrupt,) = store.list(statuses=["in-progress"])
    assert corrupt.last_error is not None and corrupt.last_error.code == "LOUSHO_CHECKPOINT_CORRUPT"
    assert corrupt.last_error.retryable is False
    with pytest.raises(errors.CheckpointCorruptError):
        store.load("run-a")


def test_sends_to_a_paused_run_are_refused(store: PostgresCheckpointStore) -> None:
    _new_run(store)
    with psycopg.connect(services.test_database_url(), autocommit=True) as conn:
        conn.execute("""UPDATE runs SET status = 'awaiting-approval',
                        document = '{"approval_ids": ["ap-1"]}' WHERE session_id = 'run-1'""")
    with pytest.raises(errors.SessionAwaitingApprovalError) as caught:
        store.append_input("run-1", "shop", [Message(role="user", content="more")])
    assert caught.value.approval_id == "ap-1"


def test_a_session_belongs_to_one_agent(store: PostgresCheckpointStore) -> None:
    _new_run(store)
    with pytest.raises(errors.ConfigurationError):
        store.append_input("run-1", "other", [Message(role="user", content="x")])


def test_sql_shaped_ids_and_payloads_are_stored_verbatim(store: PostgresCheckpointStore) -> None:
    sid = "x'--_%_.y"
    text = "'; DROP TABLE runs; -- %s %% _ \u00e9\u6f22"
    store.append_input(sid, "shop", [Message(role="user", content=text)])
    (entry,) = store.inbox(sid, 0)
    assert entry.messages[0].content == text


def test_leases_are_taken_once_and_only_their_owner_renews_or_releases(
    leases: LeaseManager, redis_client: redis.Redis
) -> None:
    first = leases.acquire("run-1")
    assert first is not None
    assert leases.acquire("run-1") is None
    impostor = type(first)("run-1", "someone-else", first.token)
    assert not leases.renew(impostor) and impostor.lost.is_set()
    assert not leases.release(impostor)
    assert leases.renew(first)
    assert leases.release(first)
    second = leases.acquire("run-1")
    assert second is not None and second.token > first.token


def test_a_lease_expires_by_itself(leases: LeaseManager, redis_client: redis.Redis) -> None:
    short = LeaseManager(redis_client, ttl_ms=50)
    assert short.acquire("run-1") is not None
    import time

    time.sleep(0.12)
    assert leases.acquire("run-1") is not None


def test_invalid_ids_never_reach_redis(leases: LeaseManager, redis_client: redis.Redis) -> None:
    with pytest.raises(errors.SessionIdInvalidError):
        leases.acquire("bad id")
    with pytest.raises(errors.SessionIdInvalidError):
        leases.acquire("x" * 201)
    assert redis_client.keys("lousho:*bad*") == [] and redis_client.keys("lousho:*xxxx*") == []


def test_redis_is_reachable(redis_client: redis.Redis) -> None:
    assert isinstance(redis_client, redis.Redis) and redis_client.ping()
