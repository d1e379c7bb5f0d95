"""The operator's JSON routes: ``GET /runs`` (the state ``Client.runs`` gives, cursor paging, key scopes),
``DELETE /runs/{id}`` (acting keys only), ``GET /approvals``, one error body for every 4xx, and
``GET /openapi.json`` valid as OpenAPI 3 and listing every JSON route."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from openapi_spec_validator import validate
from pydantic import SecretStr
from sqlalchemy import text

from producer.client import Client
from producer.server import create_app as create_server
from store.records import LastError, Message
from tests.support.http_fixtures import API_KEY, Receiver, signed_headers

pytestmark = pytest.mark.integration

READER = "reader-key-0123456789abcdef"
DESK = "desk-only-key-0123456789abcdef"
KEYS = f"reader={READER};read,desk={DESK};agents=desk"


def _bearer(key: str = API_KEY) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _keyed(receiver: Receiver) -> TestClient:
    receiver.app.state.config = dataclasses.replace(receiver.app.state.config, api_keys=SecretStr(KEYS))
    return TestClient(receiver.app)


def _deliver(http: TestClient, agent: str, body: dict[str, Any], delivery_id: str) -> str:
    raw = json.dumps(body).encode()
    answer = http.post(f"/webhooks/{agent}", content=raw, headers=signed_headers(raw, delivery_id, int(time.time())))
    assert answer.status_code == 202, answer.text
    return str(answer.json()["session_id"])


def _ids(answer: Any) -> list[str]:
    return [run["session_id"] for run in answer.json()["items"]]


def test_get_runs_lists_runs_in_the_state_client_runs_gives_them_within_the_keys_agents(receiver: Receiver) -> None:
    http = _keyed(receiver)
    paused = _deliver(http, "desk", {"request": "Refund 5"}, "op-1")
    done = _deliver(http, "hooks", {"text": "hi"}, "op-2")
    receiver.driver.drain()
    receiver.store.append_input("op-parked", "hooks", [Message(role="user", content="hi")])
    claim = receiver.store.claim("op-parked", 3, None)
    assert claim.checkpoint is not None
    receiver.store.record_failure("op-parked", claim.checkpoint.fence, LastError(code="X", retryable=False))

    everything = http.get("/runs", headers=_bearer())
    assert everything.status_code == 200
    states = {run["session_id"]: run["state"] for run in everything.json()["items"]}
    with Client(receiver.settings, engine=receiver.engine) as client:
        assert (
            states
            == {run.session_id: run.state for run in client.runs().items}
            == {paused: "awaiting-approval", done: "finished", "op-parked": "parked"}
        )
    assert http.get("/runs", headers=_bearer(READER)).json() == everything.json()
    # One run's route says the same state.
    assert {sid: http.get(f"/runs/{sid}", headers=_bearer()).json()["state"] for sid in states} == states
    # A key scoped to desk sees desk's runs only, whatever it asks for.
    assert _ids(http.get("/runs", headers=_bearer(DESK))) == [paused]
    assert _ids(http.get("/runs?agent=hooks", headers=_bearer(DESK))) == []
    assert _ids(http.get("/runs?state=finished,parked", headers=_bearer())) == ["op-parked", done]
    assert _ids(http.get("/runs?state=parked&state=finished&agent=hooks", headers=_bearer())) == ["op-parked", done]
    assert _ids(http.get("/runs?since=1h", headers=_bearer())) == ["op-parked", done, paused]
    with pytest.warns(DeprecationWarning):
        assert _ids(http.get("/runs?state=paused", headers=_bearer())) == [paused]


def test_get_runs_pages_by_cursor_with_no_duplicate_and_no_gap(receiver: Receiver) -> None:
    with receiver.engine.begin() as conn:
        conn.execute(
            text("""INSERT INTO runs (session_id, agent, status, created_at, document)
                             SELECT 'op-' || lpad(g::text, 4, '0'), 'hooks', 'finished',
                                    timestamptz '2025-01-01' + make_interval(secs => g / 3), '{"format": 2}'
                             FROM generate_series(1, 501) g""")
        )
    http = TestClient(receiver.app)
    seen: list[str] = []
    page = http.get("/runs?limit=45", headers=_bearer()).json()
    while True:
        seen.extend(run["session_id"] for run in page["items"])
        if page["next_cursor"] is None:
            break
        page = http.get("/runs", params={"limit": 45, "cursor": page["next_cursor"]}, headers=_bearer()).json()
    assert len(seen) == len(set(seen)) == 501 and seen == sorted(seen, reverse=True)


def test_delete_is_refused_to_a_read_only_key_and_deletes_for_an_acting_key(receiver: Receiver) -> None:
    http = _keyed(receiver)
    sid = _deliver(http, "hooks", {"text": "hi"}, "op-del")
    receiver.driver.drain()

    refused = http.delete(f"/runs/{sid}", headers=_bearer(READER))
    hidden = http.delete(f"/runs/{sid}", headers=_bearer(DESK))
    assert (refused.status_code, refused.json()) == (
        403,
        {"error": {"code": "LOUSHO_API_KEY_READ_ONLY", "message": "this key may read runs, not act on them"}},
    )
    assert hidden.status_code == 404 and hidden.json()["error"]["code"] == "LOUSHO_RUN_NOT_FOUND"
    assert http.get(f"/runs/{sid}", headers=_bearer()).status_code == 200

    deleted = http.delete(f"/runs/{sid}", headers=_bearer())
    assert (deleted.status_code, deleted.json()) == (200, {"session_id": sid, "deleted": True})
    assert http.get(f"/runs/{sid}", headers=_bearer()).status_code == 404
    assert http.delete(f"/runs/{sid}", headers=_bearer()).status_code == 404


def test_get_approvals_lists_the_undecided_approvals_the_key_sees(receiver: Receiver) -> None:
    http = _keyed(receiver)
    sid = _deliver(http, "desk", {"request": "Refund 5"}, "op-ap")
    receiver.driver.drain()

    listed = http.get("/approvals", headers=_bearer(READER))
    assert listed.status_code == 200
    (approval,) = listed.json()["items"]
    assert (approval["session_id"], approval["agent"], approval["kind"], approval["tool_name"]) == (
        sid,
        "desk",
        "tool",
        "refund",
    )
    assert approval["args"] == {"amount": 5} and approval["run_path"] == [sid]
    assert http.get("/approvals?agent=desk", headers=_bearer(DESK)).json() == listed.json()
    assert http.get("/approvals?agent=hooks", headers=_bearer()).json() == {"items": []}
    hooks_only = dataclasses.replace(
        receiver.app.state.config, api_keys=SecretStr(f"{KEYS},hooks=hooks-only-key-0123456789abcdef;agents=hooks")
    )
    receiver.app.state.config = hooks_only
    assert http.get("/approvals", headers=_bearer("hooks-only-key-0123456789abcdef")).json() == {"items": []}


def test_every_4xx_answers_with_one_error_body(receiver: Receiver) -> None:
    http = TestClient(receiver.app)
    answers = {
        "no key": http.get("/runs"),
        "wrong key": http.get("/approvals", headers=_bearer("not-a-key-at-all-0000")),
        "bad state": http.get("/runs?state=sleeping", headers=_bearer()),
        "bad limit": http.get("/runs?limit=0", headers=_bearer()),
        "bad cursor": http.get("/runs?cursor=nonsense", headers=_bearer()),
        "bad since": http.get("/runs?since=yesterday", headers=_bearer()),
        "unknown run": http.delete("/runs/nope", headers=_bearer()),
        "no route": http.get("/nothing-here"),
        "wrong method": http.put("/runs", headers=_bearer()),
    }
    statuses = {name: answer.status_code for name, answer in answers.items()}
    assert statuses == {
        "no key": 401,
        "wrong key": 401,
        "bad state": 400,
        "bad limit": 400,
        "bad cursor": 400,
        "bad since": 400,
        "unknown run": 404,
        "no route": 404,
        "wrong method": 405,
    }
    for name, answer in answers.items():
        body = answer.json()
        assert list(body) == ["error"] and sorted(body["error"]) == ["code", "message"], (name, body)
        assert body["error"]["code"].startswith("LOUSHO_"), (name, body)
    assert answers["no key"].headers["www-authenticate"] == "Bearer"
    assert "sleeping" not in answers["bad state"].text  # never echoes the request


def test_openapi_json_is_valid_openapi_3_and_lists_every_json_route_and_no_page(receiver: Receiver) -> None:
    app = create_server(receiver.app.state.config, receiver.app.state.backend)
    http = TestClient(app)
    document = http.get("/openapi.json")
    assert document.status_code == 200
    spec = document.json()
    validate(spec)
    assert spec["openapi"].startswith("3.")

    json_routes = {
        (route.path, method)
        for route in app.routes
        if isinstance(route, APIRoute)
        and not route.path.startswith("/ui")
        and route.path not in ("/metrics", "/openapi.json")
        for method in route.methods or ()
    }
    described = {(path, method.upper()) for path, operations in spec["paths"].items() for method in operations}
    assert json_routes == described
    assert not any(path.startswith("/ui") for path in spec["paths"])
    runs = spec["paths"]["/runs"]["get"]
    assert {p["name"] for p in runs["parameters"]} == {"agent", "state", "since", "limit", "cursor"}
    assert runs["security"] == [{"bearerKey": []}] and "400" in runs["responses"] and "401" in runs["responses"]
    assert spec["components"]["securitySchemes"]["bearerKey"]["scheme"] == "bearer"
    assert spec["paths"]["/runs/{session_id}"]["delete"]["responses"]["403"]["content"]["application/json"][
        "schema"
    ] == {"$ref": "#/components/schemas/ErrorBody"}
