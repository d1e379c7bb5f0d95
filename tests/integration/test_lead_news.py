"""News of children for their leads (``lead_news``, migration 0022): what marks it, what the lead's claim and save
make of it, what the sweep of waiting leads reads, and that telling a lead takes its locks in the store's order.
Real Postgres, the store's statements."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import psycopg
import pytest
from alembic import command
from sqlalchemy import Engine, text

from store.checkpoints import PostgresCheckpointStore
from store.database import alembic_config, make_engine, migrate
from store.settings import Settings
from tests.fakes.store_contract.subject import AGENT, claimed_run, new_run, save_next
from tests.support import services

#: Seconds a test waits for another connection to reach a lock, or to finish, before it fails.
LOCK_WAIT_S = 10.0


def _news(engine: Engine, lead: str) -> tuple[int, int] | None:
    """The lead's ``(n, seen)``, None without a row."""
    with engine.connect() as conn:
        row = conn.execute(text("SELECT n, seen FROM lead_news WHERE lead_id = :id"), {"id": lead}).first()
    return None if row is None else (int(row.n), int(row.seen))


def _unseen(engine: Engine, lead: str) -> bool:
    news = _news(engine, lead)
    return news is not None and news[0] > news[1]


def _lead_with_child(store: PostgresCheckpointStore, lead: str) -> tuple[str, int]:
    """A lead saved waiting on one child; the child's id and the lead's seq."""
    checkpoint = new_run(store, lead)
    child = f"{lead}.task-00000000000000a1"
    assert store.start_children(lead, AGENT, [(child, AGENT, "look")], fence=checkpoint.fence) == []
    saved = save_next(store, checkpoint, inbox_cursor=1, waiting=True, delegated={"call-1": child})
    return child, saved.seq


def _settle(store: PostgresCheckpointStore, child: str, token: int) -> None:
    save_next(store, claimed_run(store, child, token), status="finished", finish_reason="stop", inbox_cursor=1)


def test_a_child_that_settles_after_its_leads_claim_is_news_until_a_later_step_saves(
    store: PostgresCheckpointStore,
) -> None:
    child, _ = _lead_with_child(store, "ln-lead")
    assert not _unseen(store.engine, "ln-lead")  # its child runs: nothing for the lead yet

    lead = claimed_run(store, "ln-lead", 2)  # the lead's step begins ...
    _settle(store, child, 5)  # ... its child settles meanwhile ...
    assert _unseen(store.engine, "ln-lead")
    save_next(store, lead, waiting=True)  # ... and the step saves from what it read before
    assert _unseen(store.engine, "ln-lead"), "news the step may not have read was marked seen"
    assert [due.session_id for due in store.waiting_leads(0.0)] == ["ln-lead"]

    again = claimed_run(store, "ln-lead", 3)  # the next step begins after the child settled: it takes its result
    save_next(store, again, waiting=False, delegated=None)
    assert _news(store.engine, "ln-lead") is None


def test_a_lead_saved_waiting_on_a_child_that_already_settled_is_news(store: PostgresCheckpointStore) -> None:
    # A step may save from what it read before its child settled, or without reading it (an answer kept waiting on
    # its background tasks): its save is news for the sweep, whenever the child settled.
    child, _ = _lead_with_child(store, "ln-late")
    _settle(store, child, 5)
    save_next(store, claimed_run(store, "ln-late", 2), waiting=True)

    assert _unseen(store.engine, "ln-late")
    assert [due.session_id for due in store.waiting_leads(0.0)] == ["ln-late"]


def test_the_sweep_does_not_read_a_lead_whose_step_saw_its_childrens_news(store: PostgresCheckpointStore) -> None:
    lead = new_run(store, "ln-seen")
    done, asks = "ln-seen.task-00000000000000b1", "ln-seen.task-00000000000000b2"
    assert store.start_children("ln-seen", AGENT, [(done, AGENT, "a"), (asks, AGENT, "b")], fence=lead.fence) == []
    lead = save_next(store, lead, inbox_cursor=1, waiting=True, delegated={"call-1": done, "call-2": asks})
    _settle(store, done, 5)
    save_next(store, claimed_run(store, asks, 5), status="awaiting-approval", approval_ids=["ap-1"], inbox_cursor=1)
    assert _unseen(store.engine, "ln-seen")

    # Its next step reads both: one result taken, the other child paused on a person; it waits on that one.
    save_next(store, claimed_run(store, "ln-seen", 2), waiting=True, delegated={"call-2": asks})

    assert not _unseen(store.engine, "ln-seen")
    assert store.waiting_leads(0.0) == []


def test_a_deleted_or_paused_child_is_news_and_a_claim_of_a_stopped_child_is_not(
    store: PostgresCheckpointStore,
) -> None:
    child, _ = _lead_with_child(store, "ln-gone")
    store.claim(child, 5, None)  # a claim of a running child changes nothing its lead reads
    assert not _unseen(store.engine, "ln-gone")
    save_next(store, claimed_run(store, child, 6), status="awaiting-approval", approval_ids=["ap-1"], inbox_cursor=1)
    paused = _news(store.engine, "ln-gone")
    assert paused is not None and paused[0] > paused[1]
    store.claim(child, 7, None)  # a stale step's claim of the paused child: not news
    assert _news(store.engine, "ln-gone") == paused

    store.delete(child)

    gone = _news(store.engine, "ln-gone")
    assert gone is not None and gone[0] > paused[0]
    assert [due.session_id for due in store.waiting_leads(0.0)] == ["ln-gone"]


def test_news_goes_with_a_save_that_does_not_wait_a_stopped_lead_and_a_deleted_one(
    store: PostgresCheckpointStore,
) -> None:
    for lead in ("ln-moves", "ln-stops", "ln-deleted"):
        child, _ = _lead_with_child(store, lead)
        _settle(store, child, 5)
        assert _unseen(store.engine, lead)

    save_next(store, claimed_run(store, "ln-moves", 2), waiting=False)  # it read its children: no wait left
    assert _news(store.engine, "ln-moves") is None

    stopped = claimed_run(store, "ln-stops", 2)  # an older release's save leaves the news: the sweep drops it
    with store.engine.begin() as conn:
        conn.execute(
            text("UPDATE runs SET status = 'finished', waiting = false, seq = seq + 1 WHERE session_id = :id"),
            {"id": stopped.session_id},
        )
    assert _unseen(store.engine, "ln-stops")
    store.waiting_leads(0.0)
    assert _news(store.engine, "ln-stops") is None

    store.delete("ln-deleted")
    assert _news(store.engine, "ln-deleted") is None


@pytest.mark.parametrize("first", ["child", "delete"])
def test_a_child_settling_while_its_lead_is_deleted_waits_for_the_delete_or_the_delete_for_it(
    store: PostgresCheckpointStore, first: str
) -> None:
    """The child's write holds its row, then its lead's news; the delete the lead's row, then the child's: whichever
    comes first, the other waits for it, and no deadlock ends either."""
    lead = f"ln-race-{first}"
    child, _ = _lead_with_child(store, lead)
    url = services.test_database_url()
    done: list[object] = []
    with psycopg.connect(url) as holder:
        holder.execute("SET lock_timeout = '10s'")
        if first == "child":
            # The child's settling write, committed only once the delete waits on its row.
            holder.execute("UPDATE runs SET status = 'finished' WHERE session_id = %s", (child,))
            thread = threading.Thread(target=lambda: done.append(_delete(store, lead)))
            expected: object = True
        else:
            holder.execute("SELECT 1 FROM runs WHERE session_id = %s FOR UPDATE", (lead,))
            holder.execute("SELECT 1 FROM runs WHERE parent_id = %s FOR UPDATE", (lead,))
            thread = threading.Thread(target=lambda: done.append(_settle_raw(url, child)))
            expected = 0  # the child is gone once the write gets its row
        thread.start()
        services.wait_for_lock_waiter(store.engine, "the other side")
        if first == "delete":
            holder.execute("DELETE FROM runs WHERE session_id = ANY(%s)", ([child, lead],))
        holder.commit()
        thread.join(LOCK_WAIT_S)
    assert done == [expected], f"the other side ended with {done}"
    assert store.load(lead) is None and store.load(child) is None
    assert _news(store.engine, lead) is None


def _delete(store: PostgresCheckpointStore, lead: str) -> object:
    try:
        return store.delete(lead)
    except BaseException as exc:  # the test reports it
        return exc


def _settle_raw(url: str, child: str) -> object:
    """The child's settling write on a connection of its own: the rows it changed (0 once the child is gone)."""
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("SET lock_timeout = '10s'")
            return conn.execute("UPDATE runs SET status = 'finished' WHERE session_id = %s", (child,)).rowcount
    except BaseException as exc:  # the test reports it
        return exc


@pytest.fixture
def old_settings(settings: Settings) -> Iterator[Settings]:
    """A database of its own, built at the revision before news."""
    name = f"{services.TEST_DATABASE}_news"
    yield services.own_database(settings, name)
    services.drop_database(name)


def test_the_upgrade_gives_every_waiting_lead_news_and_the_downgrade_takes_it_back(old_settings: Settings) -> None:
    migrate(old_settings, "0021")
    engine = make_engine(old_settings)
    try:
        child = "ln-old.task-00000000000000a1"
        with engine.begin() as conn:  # stored by the previous release: a lead waiting on a child that settled since
            conn.execute(
                text("""INSERT INTO runs (session_id, agent, status, seq, waiting, document, updated_at)
                        VALUES ('ln-old', :agent, 'in-progress', 2, true,
                                jsonb_build_object('delegated', jsonb_build_object('call-1', CAST(:child AS text))),
                                now() - interval '1 minute')"""),
                {"agent": AGENT, "child": child},
            )
            conn.execute(
                text("""INSERT INTO runs (session_id, parent_id, agent, status, seq)
                        VALUES (:child, 'ln-old', :agent, 'finished', 2)"""),
                {"agent": AGENT, "child": child},
            )

        migrate(old_settings)

        assert _unseen(engine, "ln-old")
        assert [due.session_id for due in PostgresCheckpointStore(engine).waiting_leads(0.0)] == ["ln-old"]
        command.downgrade(alembic_config(old_settings), "0021")
        with engine.connect() as conn:
            assert conn.execute(text("SELECT to_regclass('lead_news')")).scalar() is None
    finally:
        engine.dispose()
