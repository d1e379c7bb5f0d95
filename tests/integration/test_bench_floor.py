"""The benchmark's protocol floor (``bench.floor``) on the real services: each hop leases, claims, saves fenced
and releases, so ``floor/bare`` measures a durable hand-over; a held lease, a stale token, a save after a later
claim and a hop delivered again are refused, or the floor would measure less than it says."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
import redis
from psycopg.rows import TupleRow

from bench import floor
from tests.support import services


@pytest.fixture
def hops() -> Iterator[floor.Floor]:
    floor.prepare(services.test_database_url())
    with psycopg.connect(services.test_database_url(), autocommit=True) as conn:  # the table outlives a test
        conn.execute(f"DELETE FROM {floor.TABLE} WHERE chain LIKE 'fl-%'")
    client = redis.Redis.from_url(services.test_redis_url())
    client.delete(*(f"bench:floor:{kind}:fl-{chain}" for kind in ("lease", "fence") for chain in "abc"))
    made = floor.Floor(services.test_database_url(), services.test_redis_url())
    yield made
    made.db.close()


def _row(chain: str) -> tuple[int, int, object]:
    with psycopg.connect(services.test_database_url(), autocommit=True) as conn:
        row: TupleRow | None = conn.execute(
            f"SELECT fence, seq, body FROM {floor.TABLE} WHERE chain = %s", (chain,)
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), row[2]


def test_each_hop_saves_its_payload_fenced_and_frees_the_lease(hops: floor.Floor) -> None:
    assert [hops.hop("fl-a", n, f"result {n}") for n in (1, 2, 3)] == [1, 2, 3]
    fence, seq, body = _row("fl-a")
    assert (fence, seq, body) == (3, 3, {"hop": 3, "result": "result 3"})
    assert not redis.Redis.from_url(services.test_redis_url()).exists("bench:floor:lease:fl-a")


def test_a_held_lease_and_a_stale_token_are_refused(hops: floor.Floor) -> None:
    hops.hop("fl-b", 1, "")
    client = redis.Redis.from_url(services.test_redis_url())
    client.set("bench:floor:lease:fl-b", "someone else", px=30_000)
    with pytest.raises(floor.FloorError, match="lease was held"):
        hops.hop("fl-b", 2, "")
    client.delete("bench:floor:lease:fl-b")

    client.set("bench:floor:fence:fl-b", 0)  # a lost Redis counter hands out a token the row has seen
    with pytest.raises(floor.FloorError, match="claim at hop 2 was fenced out"):
        hops.hop("fl-b", 2, "")
    assert _row("fl-b")[1] == 1
    assert not client.exists("bench:floor:lease:fl-b")


def test_a_save_after_a_later_claim_and_a_hop_delivered_again_are_refused(hops: floor.Floor) -> None:
    hops.hop("fl-c", 1, "")
    owner, token = hops.lease("fl-c")
    seq = hops.claim("fl-c", token, 2)
    hops.release("fl-c", owner)
    later = floor.Floor(services.test_database_url(), services.test_redis_url())  # the lease expired; another took it
    try:
        owner_2, token_2 = later.lease("fl-c")
        assert later.claim("fl-c", token_2, 2) == seq
        with pytest.raises(floor.FloorError, match="save of hop 2 was fenced out"):
            hops.save("fl-c", token, seq, "late")
        later.save("fl-c", token_2, seq, "on time")
        later.release("fl-c", owner_2)
    finally:
        later.db.close()
    assert _row("fl-c")[1:] == (2, {"hop": 2, "result": "on time"})

    with pytest.raises(floor.FloorError, match="hop 2 found the chain at hop 2"):
        hops.hop("fl-c", 2, "again")
    with psycopg.connect(services.test_database_url(), autocommit=True) as conn:
        assert floor.finished(conn, "fl-c", 2) == 1
        assert floor.finished(conn, "fl-c", 3) == 0
