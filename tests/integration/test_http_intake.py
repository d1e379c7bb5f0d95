"""Intake on the real services: one run per delivery, replays, per-agent input, run status and approvals over HTTP."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text

from producer import http as webhooks
from tests.support.http_fixtures import API_KEY, OLD_SECRET, Receiver, noted, signed_headers
from tests.support.http_recovery import run_recover_sweep

pytestmark = pytest.mark.integration

AUTH = {"authorization": f"Bearer {API_KEY}"}


def _post(client: TestClient, agent: str, body: dict[str, Any], delivery_id: str, **kw: Any) -> Any:
    raw = json.dumps(body).encode()
    return client.post(
        f"/webhooks/{agent}", content=raw, headers=signed_headers(raw, delivery_id, int(time.time()), **kw)
    )


def _count(receiver: Receiver, sql: str) -> int:
    with receiver.engine.connect() as conn:
        return int(conn.execute(text(sql)).scalar_one())


def _rows(receiver: Receiver) -> tuple[int, int, int]:
    return (
        _count(receiver, "SELECT count(*) FROM deliveries"),
        _count(receiver, "SELECT count(*) FROM runs"),
        _count(receiver, "SELECT count(*) FROM inbox"),
    )


def test_a_new_delivery_starts_one_run_that_finishes(receiver: Receiver) -> None:
    client = TestClient(receiver.app)
    response = _post(client, "hooks", {"event": "order.paid", "order": 7}, "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W")
    assert response.status_code == 202
    body = response.json()
    assert body == {
        "session_id": "job-hooks-msg_2KWPBgLlAfxdpx2AI54pPJ85f4W",
        "status": "accepted",
        "status_url": "http://testserver/runs/job-hooks-msg_2KWPBgLlAfxdpx2AI54pPJ85f4W",
        "duplicate": False,
    }
    assert _rows(receiver) == (1, 1, 1)
    receiver.driver.drain()
    checkpoint = receiver.store.load(body["session_id"])
    assert checkpoint is not None and checkpoint.status == "finished" and checkpoint.final_text == "Done."
    user = next(m for m in checkpoint.messages if m.role == "user")
    assert json.loads(user.content) == {"event": "order.paid", "order": 7}
    status = client.get(body["status_url"], headers=AUTH).json()
    assert status["status"] == "finished" and status["finish_reason"] == "stop" and status["text"] == "Done."


def test_a_replayed_delivery_creates_no_run_and_reports_the_existing_one(receiver: Receiver) -> None:
    client = TestClient(receiver.app)
    first = _post(client, "hooks", {"n": 1}, "evt-1").json()
    again = _post(client, "hooks", {"n": 1}, "evt-1").json()
    assert again["duplicate"] is True and again["session_id"] == first["session_id"]
    assert again["status"] == "running"  # not started yet: its advance is sent again, harmlessly
    receiver.driver.drain()
    done = _post(client, "hooks", {"n": 1}, "evt-1", secret=OLD_SECRET).json()
    assert done == {**first, "status": "done", "duplicate": True}
    assert _rows(receiver) == (1, 1, 0)  # the inbox was drained by the run
    assert _count(receiver, "SELECT inbox_head FROM runs") == 1
    assert noted == [first["session_id"]]


def test_a_bad_signature_writes_nothing(receiver: Receiver) -> None:
    client = TestClient(receiver.app)
    raw = b'{"n": 1}'
    headers = signed_headers(raw, "evt-2", int(time.time()))
    response = client.post("/webhooks/hooks", content=raw + b" ", headers=headers)
    assert response.status_code == 401
    assert _rows(receiver) == (0, 0, 0)


def test_the_same_delivery_id_for_two_agents_starts_one_run_each(receiver: Receiver) -> None:
    client = TestClient(receiver.app)
    a = _post(client, "hooks", {"request": "x"}, "shared-1").json()
    b = _post(client, "desk", {"request": "x"}, "shared-1").json()
    assert a["session_id"] != b["session_id"] and not a["duplicate"] and not b["duplicate"]
    assert _rows(receiver) == (2, 2, 2)


def test_an_unknown_agent_or_odd_delivery_id_is_refused_cleanly(receiver: Receiver) -> None:
    client = TestClient(receiver.app)
    assert _post(client, "nobody", {"n": 1}, "evt-3").status_code == 404
    odd = _post(client, "hooks", {"n": 1}, "weird/id:with.dots.").json()
    assert odd["session_id"].startswith("job-h") and len(odd["session_id"]) == 45
    assert _rows(receiver) == (1, 1, 1)


def test_a_configured_pointer_picks_the_agents_input_and_a_missing_one_is_422(receiver: Receiver) -> None:
    client = TestClient(receiver.app)
    ok = _post(client, "desk", {"request": "Refund order 7", "other": 1}, "desk-1").json()
    checkpoint = receiver.store.load(ok["session_id"])
    assert checkpoint is not None
    (queued,) = receiver.store.inbox(ok["session_id"], 0)
    assert queued.messages[0].content == "Refund order 7"
    missing = _post(client, "desk", {"other": 1}, "desk-2")
    assert missing.status_code == 422 and "other" not in missing.text
    assert _rows(receiver) == (1, 1, 1)


def test_a_paused_run_is_reported_then_approved_over_http(receiver: Receiver) -> None:
    client = TestClient(receiver.app)
    sid = _post(client, "desk", {"request": "Refund 5"}, "desk-3").json()["session_id"]
    receiver.driver.drain()
    assert _post(client, "desk", {"request": "Refund 5"}, "desk-3").json()["status"] == "awaiting-approval"
    status = client.get(f"/runs/{sid}", headers=AUTH).json()
    assert status["status"] == "awaiting-approval"
    (pending,) = status["pending_approvals"]
    assert pending["tool_name"] == "refund" and pending["args"] == {"amount": 5}
    assert (pending["kind"], pending["question"]) == ("tool", None)
    decision = {"approved": True, "note": "fine"}
    response = client.post(
        f"/approvals/{pending['approval_id']}",
        content=json.dumps(decision),
        headers={**AUTH, "content-type": "application/json"},
    )
    assert response.status_code == 200
    assert response.json()["run_continues"] is True and response.json()["session_id"] == sid
    again = client.post(
        f"/approvals/{pending['approval_id']}",
        content=json.dumps(decision),
        headers={**AUTH, "content-type": "application/json"},
    )
    assert again.status_code == 404
    receiver.driver.drain()
    assert client.get(f"/runs/{sid}", headers=AUTH).json()["text"] == "Refunded."
    assert _post(client, "desk", {"request": "Refund 5"}, "desk-3").json()["status"] == "done"


def test_run_status_of_unknown_or_invalid_ids_is_404(receiver: Receiver) -> None:
    client = TestClient(receiver.app)
    assert client.get("/runs/nope", headers=AUTH).status_code == 404
    assert client.get("/runs/..bad..", headers=AUTH).status_code == 404
    bad = client.post(
        "/approvals/x", content=b'{"approved": "yes"}', headers={**AUTH, "content-type": "application/json"}
    )
    assert bad.status_code == 400


def test_healthz_answers_from_the_database(receiver: Receiver) -> None:
    assert TestClient(receiver.app).get("/healthz").json() == {"status": "ok"}


def _die_between_commit_and_publish(monkeypatch: pytest.MonkeyPatch, client: TestClient, delivery_id: str) -> None:
    class Died(BaseException):
        """The receiver process dying between the commit and the publish (crash point cp13)."""

    def die(point: str, session_id: str) -> None:
        if point == "webhook_commit_before_enqueue":
            raise Died

    monkeypatch.setattr(webhooks.intake, "crash_point", die)
    with pytest.raises(Died):
        _post(client, "hooks", {"n": 1}, delivery_id)
    monkeypatch.setattr(webhooks.intake, "crash_point", lambda point, session_id: None)


def test_a_publish_lost_after_the_commit_is_repaired_by_the_recover_sweep(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = TestClient(receiver.app)
    _die_between_commit_and_publish(monkeypatch, client, "lost-1")
    assert not receiver.driver.queue and _rows(receiver) == (1, 1, 1)
    waited = run_recover_sweep(receiver, monkeypatch, "job-hooks-lost-1")
    receiver.driver.drain()
    checkpoint = receiver.store.load("job-hooks-lost-1")
    print(
        f"\n  publish lost after the commit: the recover sweep re-sent the run after {waited:.1f} s;"
        f" status {checkpoint and checkpoint.status}, tool executions {len(noted)}"
    )
    assert checkpoint is not None and checkpoint.status == "finished" and checkpoint.final_text == "Done."
    assert noted == ["job-hooks-lost-1"]


def test_a_publish_lost_after_the_commit_is_repaired_by_a_redelivery(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = TestClient(receiver.app)
    _die_between_commit_and_publish(monkeypatch, client, "lost-2")
    assert not receiver.driver.queue and _rows(receiver) == (1, 1, 1)
    again = _post(client, "hooks", {"n": 1}, "lost-2").json()
    assert again["duplicate"] is True and again["status"] == "running" and receiver.driver.queue
    receiver.driver.drain()
    checkpoint = receiver.store.load("job-hooks-lost-2")
    assert checkpoint is not None and checkpoint.status == "finished"


def test_an_answer_for_a_tool_approval_is_refused_over_http_and_leaves_it_pending(receiver: Receiver) -> None:
    client = TestClient(receiver.app)
    sid = _post(client, "desk", {"request": "Refund 5"}, "desk-4").json()["session_id"]
    receiver.driver.drain()
    (pending,) = client.get(f"/runs/{sid}", headers=AUTH).json()["pending_approvals"]
    refused = client.post(
        f"/approvals/{pending['approval_id']}",
        content=json.dumps({"answer": "yes"}),
        headers={**AUTH, "content-type": "application/json"},
    )
    assert refused.status_code == 400 and "questions" in refused.text
    assert (
        client.get(f"/runs/{sid}", headers=AUTH).json()["pending_approvals"][0]["approval_id"] == pending["approval_id"]
    )


def test_a_decision_after_the_expiry_is_410_and_the_run_goes_on_with_the_rejection(receiver: Receiver) -> None:
    client = TestClient(receiver.app)
    sid = _post(client, "desk", {"request": "Refund 5"}, "desk-5").json()["session_id"]
    receiver.driver.drain()
    (pending,) = client.get(f"/runs/{sid}", headers=AUTH).json()["pending_approvals"]
    with receiver.engine.begin() as conn:
        conn.execute(
            text("UPDATE approvals SET expires_at = now() - interval '1 second' WHERE approval_id = :id"),
            {"id": pending["approval_id"]},
        )
    late = client.post(
        f"/approvals/{pending['approval_id']}",
        content=json.dumps({"approved": True}),
        headers={**AUTH, "content-type": "application/json"},
    )
    assert late.status_code == 410 and late.json()["error"]["code"] == "LOUSHO_APPROVAL_EXPIRED"
    assert receiver.driver.queue  # the expiry was the last decision: the run was sent on
    receiver.driver.drain()
    status = client.get(f"/runs/{sid}", headers=AUTH).json()
    assert (status["status"], status["text"]) == ("finished", "Refunded.")
    checkpoint = receiver.store.load(sid)
    assert checkpoint is not None
    (result,) = [json.loads(str(m.content)) for m in checkpoint.messages if m.role == "tool"]
    assert result["kind"] == "rejected" and result["note"].startswith("expired: no decision before ")
    again = client.post(
        f"/approvals/{pending['approval_id']}",
        content=json.dumps({"approved": True}),
        headers={**AUTH, "content-type": "application/json"},
    )
    assert again.status_code == 404


def test_a_configured_header_or_field_gives_the_deliverys_run_its_fairness_key(receiver: Receiver) -> None:
    client = TestClient(receiver.app)
    raw = json.dumps({"n": 1}).encode()
    by_header = client.post(
        "/webhooks/hooks",
        content=raw,
        headers={**signed_headers(raw, "fair-1", int(time.time())), "x-tenant": "tenant-acme"},
    ).json()
    by_field = _post(client, "desk", {"request": "Refund 5", "tenant": "globex"}, "fair-2").json()
    without = _post(client, "desk", {"request": "Refund 6"}, "fair-3").json()
    keys = [receiver.store.inbox(sent["session_id"], 0)[0].fairness_key for sent in (by_header, by_field, without)]
    assert keys == ["tenant-acme", "globex", None]
    malformed = _post(client, "desk", {"request": "Refund 7", "tenant": "no spaces"}, "fair-4")
    assert malformed.status_code == 422 and "LOUSHO_WEBHOOK_FAIRNESS_INVALID" in malformed.text
