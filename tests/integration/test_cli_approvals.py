"""``lousho approvals list|approve|reject`` on the real services, with a run paused on a gated transfer."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

import pytest
import redis
from sqlalchemy import text

from producer.client import Client
from store.leases import LeaseManager
from tests.support.cli_fixtures import Lousho, drive_in_background
from tests.support.driver import Driver

pytestmark = pytest.mark.integration


def test_list_says_when_nothing_waits(lousho: Lousho) -> None:
    assert lousho("approvals", "list").out == "no pending approvals\n"
    assert lousho("approvals", "list", "--json").json() == []


def test_list_shows_the_gated_call(lousho: Lousho, paused: tuple[Driver, str]) -> None:
    _, approval_id = paused

    printed = lousho("approvals", "list")
    as_json = lousho("approvals", "list", "--json")
    other_agent = lousho("approvals", "list", "--agent", "weather", "--json")

    assert printed.code == 0
    assert printed.out.startswith(f'{approval_id}  bank  b-1  transfer({{"amount": 10}})  call ')
    [approval] = as_json.json()
    assert approval["approval_id"] == approval_id and approval["session_id"] == "b-1"
    assert approval["tool_name"] == "transfer" and approval["args"] == {"amount": 10}
    assert approval["status"] == "pending" and "fingerprint" not in approval
    assert other_agent.json() == []


def test_approve_decides_and_the_run_is_pending_again(lousho: Lousho, paused: tuple[Driver, str]) -> None:
    _, approval_id = paused

    as_json = lousho("approvals", "approve", approval_id, "--note", "fine", "--json")

    assert as_json.code == 0
    assert as_json.json() == {"approval_id": approval_id, "decision": "approved", "session_id": "b-1"}
    assert lousho("approvals", "list", "--json").json() == []
    [run] = lousho("pending", "--json").json()
    assert run["session_id"] == "b-1" and run["status"] == "in-progress"


def test_reject_prints_the_decision(lousho: Lousho, paused: tuple[Driver, str]) -> None:
    _, approval_id = paused

    printed = lousho("approvals", "reject", approval_id, "--agent", "bank")

    assert (printed.code, printed.out) == (0, f"rejected {approval_id} (run b-1)\n")


def test_approve_wait_prints_how_the_run_settled(lousho: Lousho, paused: tuple[Driver, str], client: Client) -> None:
    driver, approval_id = paused

    def decided() -> bool:
        checkpoint = client.store.load("b-1")
        return checkpoint is not None and checkpoint.status == "in-progress"

    thread = drive_in_background(driver, "b-1", decided)

    printed = lousho("approvals", "approve", approval_id, "--wait", "--timeout", "30")
    thread.join(30)

    assert printed.code == 0, printed.err
    assert printed.out == f"approved {approval_id}; b-1: stop after 2 step(s)\nDone.\n"


def test_an_unknown_approval_prints_its_code(lousho: Lousho, paused: tuple[Driver, str]) -> None:
    _, approval_id = paused

    unknown = lousho("approvals", "approve", "appr-nope")
    as_json = lousho("approvals", "reject", "appr-nope", "--json")
    other_agent = lousho("approvals", "approve", approval_id, "--agent", "weather")
    decided = [lousho("approvals", "approve", approval_id), lousho("approvals", "approve", approval_id)]

    assert unknown.code == 1 and unknown.error_code() == "LOUSHO_APPROVAL_NOT_FOUND"
    assert as_json.code == 1 and as_json.json()["error"]["code"] == "LOUSHO_APPROVAL_NOT_FOUND"
    assert other_agent.code == 1 and other_agent.error_code() == "LOUSHO_APPROVAL_NOT_FOUND"
    assert decided[0].code == 0
    assert decided[1].code == 1 and decided[1].error_code() == "LOUSHO_APPROVAL_NOT_FOUND"


def test_approve_without_an_id_prints_the_configuration_code(lousho: Lousho) -> None:
    printed = lousho("approvals", "approve")
    as_json = lousho("approvals", "reject", "--json")

    assert printed.code == 1 and printed.error_code() == "LOUSHO_CONFIG_INVALID"
    assert "approvals approve needs an approval id" in printed.err
    assert as_json.code == 1 and as_json.json()["error"]["code"] == "LOUSHO_CONFIG_INVALID"


def test_answer_decides_a_question_and_is_refused_for_a_tool_call(
    lousho: Lousho, paused: tuple[Driver, str], make_driver: Callable[..., Driver], client: Client
) -> None:
    from worker import Agent
    from worker.providers import MockModel

    _, transfer_id = paused
    refused = lousho("approvals", "answer", transfer_id, "yes")
    assert refused.code == 1 and "LOUSHO_CONFIG_INVALID" in refused.err

    driver = make_driver(
        Agent(
            name="asker",
            ask_question=True,
            model=MockModel(
                [
                    {
                        "tool_calls": [
                            {"name": "ask_question", "args": {"question": "Which city?", "options": ["Oslo"]}}
                        ]
                    },
                    "Going to Oslo.",
                ]
            ),
        )
    )
    client.agent("asker").send("plan", session_id="ask-1", check_agent=False)
    driver.drain("ask-1")
    listed = lousho("approvals", "list", "--agent", "asker")
    assert "question: Which city?" in listed.out and '["Oslo"]' in listed.out
    question_id = lousho("approvals", "list", "--agent", "asker", "--json").json()[0]["approval_id"]
    answered = lousho("approvals", "answer", question_id, "Oslo", "--json")
    assert answered.code == 0 and answered.json()["decision"] == "answered"
    driver.drain("ask-1")
    checkpoint = client.store.load("ask-1")
    assert checkpoint is not None and checkpoint.finish_reason == "stop"
    assert [m.content for m in checkpoint.messages if m.role == "tool"] == ['{"answer":"Oslo"}']


def test_list_shows_the_expiry_and_a_decision_after_it_prints_the_expired_code(
    lousho: Lousho, paused: tuple[Driver, str], client: Client
) -> None:
    _, approval_id = paused

    def expire_in(seconds: int) -> None:
        with client.engine.begin() as conn:
            conn.execute(
                text("UPDATE approvals SET expires_at = now() + make_interval(secs => :s) WHERE approval_id = :id"),
                {"s": seconds, "id": approval_id},
            )

    assert "expires" not in lousho("approvals", "list").out
    expire_in(3600)
    [listed] = lousho("approvals", "list", "--json").json()
    printed = lousho("approvals", "list")
    assert listed["expires_at"] is not None
    assert printed.out.rstrip("\n").endswith(f"  expires {datetime.fromisoformat(listed['expires_at']).isoformat()}")

    expire_in(-1)
    late = lousho("approvals", "approve", approval_id)
    as_json = lousho("approvals", "reject", approval_id, "--json")

    assert late.code == 1 and late.error_code() == "LOUSHO_APPROVAL_EXPIRED"
    assert "expired before this decision; it was recorded as rejected" in late.err
    assert as_json.code == 1 and as_json.json()["error"]["code"] == "LOUSHO_APPROVAL_NOT_FOUND"  # decided now
    assert lousho("approvals", "list", "--json").json() == []
    [run] = lousho("pending", "--json").json()
    assert run["session_id"] == "b-1" and run["status"] == "in-progress"


def test_a_reconciliation_is_listed_and_answered_with_the_call_s_result(
    lousho: Lousho, make_driver: Callable[..., Driver], client: Client, leases: LeaseManager, redis_client: redis.Redis
) -> None:
    from store import keys
    from tests.fakes.crash import die_at
    from worker import Agent, tool
    from worker.providers import MockModel

    @tool(once=True)
    def charge(order: str) -> str:
        """Charge the card for an order."""
        return f"charged {order}"

    driver = make_driver(
        Agent(
            name="till",
            tools=[charge],
            model=MockModel([{"tool_calls": [{"name": "charge", "args": {"order": "7"}}]}, "Charged."]),
        )
    )
    client.agent("till").send("charge order 7", session_id="till-1", check_agent=False)
    die_at("after_once_effect_before_result_save", "till-1", leases, lambda: driver.drain("till-1"))
    driver.queue.clear()
    redis_client.delete(keys.lease_key("till-1"))  # the dead worker's lease expired
    driver.drain("till-1")

    listed = lousho("approvals", "list", "--agent", "till")
    assert 'reconcile: charge({"order": "7"})' in listed.out and "answer ID TEXT" in listed.out
    [asked] = lousho("approvals", "list", "--agent", "till", "--json").json()
    assert asked["kind"] == "reconcile" and "Did it take effect?" in asked["question"]
    answered = lousho("approvals", "answer", asked["approval_id"], "charged 7 (checked)", "--json")
    assert answered.code == 0 and answered.json()["decision"] == "answered"
    driver.drain("till-1")
    checkpoint = client.store.load("till-1")
    assert checkpoint is not None and checkpoint.finish_reason == "stop"
    assert [m.content for m in checkpoint.messages if m.role == "tool"] == ["charged 7 (checked)"]
