"""Intake holes on the real services: secrets bound to agents, GitHub replays under new ids, delivery ids that
would address a fork or a reserved key, bodies that are not valid Unicode, and a broker down after the commit.

Each test prints what it saw.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import time
import uuid
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import text

from producer.client import Client
from producer.http import Backend, WebhookConfig, create_app
from store.database import make_engine
from tests.support import services
from tests.support.http_fixtures import API_KEY, SECRET, Receiver, noted, signed_headers, webhook_config
from tests.support.http_recovery import run_recover_sweep

pytestmark = pytest.mark.integration

HOOKS_ONLY = "whsec_" + base64.b64encode(b"hooks-only-secret-0123456789abcd").decode()
DESK_ONLY = "whsec_" + base64.b64encode(b"desk-only-secret-0123456789abcde").decode()


def _count(receiver: Receiver, sql: str) -> int:
    with receiver.engine.connect() as conn:
        return int(conn.execute(text(sql)).scalar_one())


def _rows(receiver: Receiver) -> tuple[int, int, int]:
    return (
        _count(receiver, "SELECT count(*) FROM deliveries"),
        _count(receiver, "SELECT count(*) FROM runs"),
        _count(receiver, "SELECT count(*) FROM inbox"),
    )


def _standard(client: TestClient, agent: str, body: bytes, delivery_id: str, secret: str = SECRET) -> Any:
    return client.post(
        f"/webhooks/{agent}", content=body, headers=signed_headers(body, delivery_id, int(time.time()), secret)
    )


def _github(client: TestClient, agent: str, body: bytes, delivery_id: str, secret: bytes) -> Any:
    headers = {
        "content-type": "application/json",
        "x-github-event": "issues",
        "x-github-delivery": delivery_id,
        "x-hub-signature-256": "sha256=" + hmac.new(secret, body, hashlib.sha256).hexdigest(),
    }
    return client.post(f"/webhooks/{agent}", content=body, headers=headers)


def _bound_app(receiver: Receiver) -> FastAPI:
    config = webhook_config(
        LOUSHO_WEBHOOK_SECRETS=f"hooks={HOOKS_ONLY},desk={DESK_ONLY},{SECRET}",
        LOUSHO_GITHUB_WEBHOOK_SECRETS="hooks=gh-hooks-only,gh-shared",
        LOUSHO_API_KEY=API_KEY,
        LOUSHO_WEBHOOK_INPUT="desk=/request",
    )
    return create_app(config, receiver.app.state.backend)


def test_a_secret_bound_to_one_agent_cannot_start_another(receiver: Receiver) -> None:
    client = TestClient(_bound_app(receiver))
    body = json.dumps({"request": "Refund order 7"}).encode()
    crossed = [
        _standard(client, "desk", body, "cross-1", HOOKS_ONLY).status_code,
        _standard(client, "hooks", body, "cross-2", DESK_ONLY).status_code,
        _github(client, "desk", body, "cross-3", b"gh-hooks-only").status_code,
    ]
    rows_after_crossed = _rows(receiver)
    own = [
        _standard(client, "hooks", body, "own-1", HOOKS_ONLY).status_code,
        _standard(client, "desk", body, "own-2", DESK_ONLY).status_code,
        _github(client, "hooks", body, "own-3", b"gh-hooks-only").status_code,
    ]
    shared = [
        _standard(client, "desk", body, "shared-1", SECRET).status_code,
        _github(client, "desk", body, "shared-2", b"gh-shared").status_code,
    ]
    print(
        f"\n  another agent's secret -> {crossed}, rows {rows_after_crossed}; own secret -> {own};"
        f" unbound secret -> {shared}; rows {_rows(receiver)}"
    )
    assert crossed == [401, 401, 401] and rows_after_crossed == (0, 0, 0)
    assert own == [202, 202, 202] and shared == [202, 202]
    assert _rows(receiver) == (5, 5, 5)


def test_a_github_delivery_replayed_under_new_delivery_ids_starts_nothing(receiver: Receiver) -> None:
    client = TestClient(receiver.app)
    body = json.dumps({"action": "opened", "issue": {"number": 7}, "request": "Look at issue 7"}).encode()
    first = _github(client, "hooks", body, str(uuid.uuid4()), b"gh-secret").json()
    replays = [_github(client, "hooks", body, str(uuid.uuid4()), b"gh-secret") for _ in range(5)]
    answers = sorted({(r.status_code, r.json()["session_id"], r.json()["duplicate"]) for r in replays})
    other_agent = _github(client, "desk", body, str(uuid.uuid4()), b"gh-secret").json()
    changed = _github(client, "hooks", body.replace(b"7", b"8"), str(uuid.uuid4()), b"gh-secret").json()
    receiver.driver.drain()
    print(
        f"\n  first {first['session_id']} duplicate={first['duplicate']}; 5 replays under new ids -> {answers};"
        f" rows (deliveries, runs, inbox) {_rows(receiver)}, tool executions {len(noted)}"
    )
    assert first["duplicate"] is False
    assert answers == [(202, first["session_id"], True)]
    assert other_agent["duplicate"] is False and other_agent["session_id"] != first["session_id"]
    assert changed["duplicate"] is False
    assert _count(receiver, "SELECT count(*) FROM deliveries") == 3
    assert _count(receiver, "SELECT count(*) FROM runs") == 3
    assert _count(receiver, "SELECT count(*) FROM delivery_bodies") == 3
    assert sorted(noted) == sorted([first["session_id"], changed["session_id"]])


def test_a_delivery_id_cannot_address_a_fork_or_a_reserved_key(receiver: Receiver) -> None:
    client = TestClient(receiver.app)
    body = json.dumps({"n": 1}).encode()
    base = _standard(client, "hooks", body, "abc").json()["session_id"]
    receiver.driver.drain()
    with Client(receiver.settings) as producer:
        fork = producer.agent("hooks").fork(base, from_step=1)
    fork_inbox = _count(receiver, f"SELECT inbox_head FROM runs WHERE session_id = '{fork.session_id}'")
    answers = {}
    for suffix in (".fork-1", ".fork-2", ".task-0123456789abcdef", ".turn-3", ".paused", ".fire"):
        response = _standard(client, "hooks", body, "abc" + suffix)
        answers[suffix] = (response.status_code, response.json()["session_id"])
    print(f"\n  run {base}, its fork {fork.session_id}; deliveries abc.<suffix> -> {answers}")
    ids = [session_id for _, session_id in answers.values()]
    assert all(status == 202 for status, _ in answers.values())
    assert len(set(ids)) == len(ids) and base not in ids and fork.session_id not in ids
    assert not any(session_id.startswith(base + ".") for session_id in ids)
    assert _count(receiver, f"SELECT inbox_head FROM runs WHERE session_id = '{fork.session_id}'") == fork_inbox


def test_a_body_that_is_not_utf8_json_is_4xx_and_lone_surrogates_become_fffd(receiver: Receiver) -> None:
    client = TestClient(receiver.app, raise_server_exceptions=False)
    refused = {
        "latin-1 byte": b'{"text": "caf\xe9"}',
        "encoded surrogate": b'{"text": "\xed\xa0\x80"}',
        "utf-16": '{"text": "hi"}'.encode("utf-16"),
    }
    refused_status = {
        name: _standard(client, "hooks", raw, f"bad-{n}").status_code for n, (name, raw) in enumerate(refused.items())
    }
    rows_after_refused = _rows(receiver)
    escaped = b'{"text": "tail \\ud800 end", "\\udfff": ["\\ud83d"], "pair": "\\ud83d\\ude00"}'
    whole = _standard(client, "hooks", escaped, "lone-1")
    pointed = _standard(client, "desk", b'{"request": "Refund \\udc00 order 7"}', "lone-2")
    print(
        f"\n  refused bodies -> {refused_status}; lone-surrogate escapes -> {whole.status_code}, {pointed.status_code}"
    )
    assert all(400 <= status < 500 for status in refused_status.values())
    assert rows_after_refused == (0, 0, 0)
    assert whole.status_code == 202 and pointed.status_code == 202
    (queued,) = receiver.store.inbox(whole.json()["session_id"], 0)
    assert json.loads(str(queued.messages[0].content)) == {
        "text": "tail \ufffd end",
        "\ufffd": ["\ufffd"],
        "pair": "\U0001f600",
    }
    (queued,) = receiver.store.inbox(pointed.json()["session_id"], 0)
    assert queued.messages[0].content == "Refund \ufffd order 7"
    receiver.driver.drain()
    checkpoint = receiver.store.load(whole.json()["session_id"])
    assert checkpoint is not None and checkpoint.status == "finished"


def test_a_broker_error_after_the_commit_answers_202_and_the_recover_sweep_runs_the_delivery(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A real producer client whose broker refuses connections; Postgres is up.
    settings = services.test_settings(broker_url="redis://127.0.0.1:1/0")
    engine = make_engine(settings, pool_size=2)
    producer = Client(settings, engine=engine)
    try:
        config: WebhookConfig = receiver.app.state.config
        client = TestClient(create_app(config, Backend.from_client(producer)), raise_server_exceptions=False)
        body = json.dumps({"n": 1}).encode()
        with caplog.at_level(logging.WARNING, logger="lousho.webhooks"):
            started = time.monotonic()
            response = _standard(client, "hooks", body, "broker-down-1")
            answered_in = time.monotonic() - started
        rows = _rows(receiver)
        warnings = [r.getMessage() for r in caplog.records if r.name == "lousho.webhooks"]
        print(
            f"\n  broker down after the commit -> {response.status_code} {response.text} in {answered_in:.1f} s;"
            f" rows {rows}; warnings {warnings}"
        )
        assert response.status_code == 202 and response.json()["session_id"] == "job-hooks-broker-down-1"
        assert rows == (1, 1, 1)
        assert any("job-hooks-broker-down-1" in w and "recover" in w for w in warnings)
        again = _standard(client, "hooks", body, "broker-down-1")
        assert again.status_code == 202 and again.json()["duplicate"] is True
    finally:
        producer.close()
        engine.dispose()
    waited = run_recover_sweep(receiver, monkeypatch, "job-hooks-broker-down-1")
    receiver.driver.drain()
    checkpoint = receiver.store.load("job-hooks-broker-down-1")
    print(f"  the recover sweep re-sent it after {waited:.1f} s; status {checkpoint and checkpoint.status}")
    assert checkpoint is not None and checkpoint.status == "finished" and checkpoint.final_text == "Done."
    assert noted == ["job-hooks-broker-down-1"]
