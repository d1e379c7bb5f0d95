"""Named API keys on the JSON routes: read-only keys read and cannot act, agent-scoped keys see only their runs."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from producer.http.access import Keys, Principal
from store import errors
from tests.support.http_fixtures import Receiver, signed_headers

pytestmark = pytest.mark.integration

READER = "reader-key-0123456789abcdef"
DESK = "desk-only-key-0123456789abcdef"
HOOKS = "hooks-only-key-0123456789abcdef"
KEYS = f"reader={READER};read,desk={DESK};agents=desk,hooks={HOOKS};agents=hooks"


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}", "content-type": "application/json"}


def test_keys_are_parsed_with_their_scopes_and_malformed_lists_are_refused() -> None:
    keys = Keys.parse(SecretStr("legacy"), SecretStr(KEYS))
    assert keys.find("legacy") == Principal("default")
    assert keys.find(READER) == Principal("reader", read_only=True)
    assert keys.find(DESK) == Principal("desk", agents=frozenset({"desk"}))
    assert keys.find("nope") is None and keys.find("") is None
    desk = keys.find(DESK)
    assert desk is not None and desk.sees("desk") and not desk.sees("hooks") and desk.acts_on("desk")
    reader = keys.find(READER)
    assert reader is not None and reader.sees("hooks") and not reader.acts_on("hooks")
    for bad in ("x=short", "noequals", f"a={READER};write", f"a={READER};agents=", f"a={READER},a={DESK}"):
        with pytest.raises(errors.ConfigurationError) as refused:
            Keys.parse(None, SecretStr(bad))
        assert READER not in refused.value.message and DESK not in refused.value.message


def test_a_read_only_key_reads_and_cannot_act_and_a_scoped_key_sees_only_its_agents_runs(receiver: Receiver) -> None:
    receiver.app.state.config = dataclasses.replace(receiver.app.state.config, api_keys=SecretStr(KEYS))
    client = TestClient(receiver.app)
    raw = json.dumps({"request": "Refund 5"}).encode()
    accepted = client.post("/webhooks/desk", content=raw, headers=signed_headers(raw, "acc-1", int(time.time())))
    sid = accepted.json()["session_id"]
    receiver.driver.drain()
    seen = client.get(f"/runs/{sid}", headers=_bearer(READER))
    assert seen.status_code == 200 and seen.json()["status"] == "awaiting-approval"
    (pending,) = seen.json()["pending_approvals"]
    decision = json.dumps({"approved": True})
    # Read-only: 403 on every act.
    assert (
        client.post(f"/approvals/{pending['approval_id']}", content=decision, headers=_bearer(READER)).status_code
        == 403
    )
    assert client.post(f"/runs/{sid}/abort", headers=_bearer(READER)).status_code == 403
    # Another agent's key: the run, its events and its approval do not exist.
    assert client.get(f"/runs/{sid}", headers=_bearer(HOOKS)).status_code == 404
    assert client.get(f"/runs/{sid}/events", headers=_bearer(HOOKS)).status_code == 404
    assert (
        client.post(f"/approvals/{pending['approval_id']}", content=decision, headers=_bearer(HOOKS)).status_code == 404
    )
    assert client.post(f"/runs/{sid}/abort", headers=_bearer(HOOKS)).status_code == 404
    assert client.get(f"/runs/{sid}", headers=_bearer("unknown-key-0123456789")).status_code == 401
    # The run's own agent's key acts.
    decided = client.post(f"/approvals/{pending['approval_id']}", content=decision, headers=_bearer(DESK))
    assert decided.status_code == 200 and decided.json()["run_continues"] is True
