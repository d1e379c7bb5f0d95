"""The rule of I19 (``store.explain``): what an unfinished run waits on, what moves it next, and if anything does."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from store.explain import Observed, explain
from store.records import LastError

NOW = datetime(2025, 3, 1, 12, 0, 0, tzinfo=UTC)
GRACE = timedelta(seconds=60)


def _run(state: str, **facts: object) -> Observed:
    base = Observed(
        session_id="order-7",
        agent="shop",
        state=state,  # type: ignore[arg-type]
        now=NOW,
        since=NOW - timedelta(seconds=5),
    )
    return replace(base, **facts)  # type: ignore[arg-type]


def test_a_finished_run_waits_on_nothing() -> None:
    told = explain(_run("finished", since=NOW - timedelta(days=3), agent_served=False), GRACE)
    assert told.explained and not told.overdue and told.waiting_on.model_dump(exclude_defaults=True) == {}
    assert told.next_action.startswith("nothing: it is finished")


def test_a_parked_run_waits_on_a_person_who_fixes_its_error() -> None:
    told = explain(
        _run(
            "parked",
            since=NOW - timedelta(days=3),
            last_error=LastError(code="LOUSHO_AGENT_DRIFT", message="tools changed"),
        ),
        GRACE,
    )
    assert told.explained and not told.overdue and told.waiting_on.person
    assert "LOUSHO_AGENT_DRIFT: tools changed" in told.next_action and "resume it or send again" in told.next_action


def test_aborted_and_budget_stopped_runs_wait_on_a_person() -> None:
    aborted = explain(_run("aborted", since=NOW - timedelta(days=1)), GRACE)
    budget = explain(_run("budget-exceeded", since=NOW - timedelta(days=1)), GRACE)
    assert aborted.explained and aborted.waiting_on.person and "send to it again, or resume it" in aborted.next_action
    assert budget.explained and budget.waiting_on.person and "raised limits" in budget.next_action


def test_a_run_awaiting_approval_names_its_approvals() -> None:
    told = explain(_run("awaiting-approval", since=NOW - timedelta(days=2), approval_ids=("ap-1", "ap-2")), GRACE)
    assert told.explained and told.waiting_on.person and told.waiting_on.approval_ids == ["ap-1", "ap-2"]
    assert told.next_action == "a person: decide the approval(s) ap-1, ap-2 (lousho approvals list)"


def test_a_lead_waiting_on_a_child_that_waits_on_a_person_names_the_childs_approval() -> None:
    told = explain(
        _run(
            "waiting",
            since=NOW - timedelta(hours=1),
            children=("order-7.task-0123456789abcdef",),
            approval_ids=("ap-child",),
        ),
        GRACE,
    )
    assert told.explained and told.waiting_on.children == ["order-7.task-0123456789abcdef"]
    assert told.next_action == "a person: decide the approval(s) of its children ap-child (lousho approvals list)"


def test_a_lead_waiting_on_running_children_is_woken_by_the_last_to_settle() -> None:
    children = tuple(f"order-7.task-{n:016x}" for n in range(5))
    told = explain(_run("waiting", since=NOW - timedelta(hours=1), children=children), GRACE)
    assert told.explained and not told.waiting_on.person
    assert told.next_action == (
        f"its sub-agents' runs {', '.join(children[:3])} and 2 more: the last to settle wakes it"
    )


def test_a_lead_whose_children_all_settled_needs_a_step_like_any_run_with_work() -> None:
    told = explain(_run("waiting", since=NOW - timedelta(minutes=5)), GRACE)
    assert not told.explained and told.overdue


def test_a_retrying_run_waits_for_its_next_attempt_and_then_needs_a_step() -> None:
    retry_at = NOW + timedelta(seconds=40)
    told = explain(_run("retrying", next_attempt_at=retry_at, since=retry_at), GRACE)
    assert told.explained and told.waiting_on.retry_at == retry_at
    assert told.next_action == "its next attempt at 2025-03-01 12:00:40Z (resume() tries at once)"
    # Once the time has come, the run needs a step: the sweep sends it within the grace, after that it is overdue.
    due = _run("retrying", next_attempt_at=NOW - timedelta(seconds=10), since=NOW - timedelta(seconds=10))
    assert not explain(due, GRACE).explained and not explain(due, GRACE).overdue
    late = replace(due, next_attempt_at=NOW - timedelta(seconds=61), since=NOW - timedelta(seconds=61))
    assert explain(late, GRACE).overdue and explain(late, GRACE).waiting_on.retry_at is None


def test_a_running_run_held_by_a_worker_names_the_worker_and_the_lease_age() -> None:
    told = explain(_run("running", since=NOW - timedelta(hours=1), lease_holder="host:12:ab", lease_age_ms=800), GRACE)
    assert told.explained and (told.waiting_on.lease_holder, told.waiting_on.lease_age_ms) == ("host:12:ab", 800)
    assert told.next_action == "the worker host:12:ab runs its step now"


def test_a_running_run_with_a_step_message_waits_for_a_worker_and_says_when_none_serves_its_agent() -> None:
    queued = explain(_run("running", since=NOW - timedelta(hours=1), step_message="queued"), GRACE)
    assert queued.explained and queued.next_action == "a worker takes its step message (queued)"
    unserved = explain(
        _run("running", since=NOW - timedelta(hours=1), step_message="reserved", agent_served=False), GRACE
    )
    assert unserved.explained and unserved.waiting_on.unserved_agent == "shop"
    assert "no live worker serves agent 'shop' now" in unserved.next_action


def test_a_run_nothing_moves_is_unexplained_and_overdue_after_the_grace() -> None:
    fresh = explain(_run("running", since=NOW - timedelta(seconds=59)), GRACE)
    assert not fresh.explained and not fresh.overdue
    assert fresh.next_action.startswith("the recovery sweep, which sends it a step by 2025-03-01 12:00:01Z")
    stuck = explain(_run("running", since=NOW - timedelta(seconds=61)), GRACE)
    assert not stuck.explained and stuck.overdue
    assert stuck.next_action.startswith("nothing seen moves it: no lease, no step message, no timer, no waiter")
