"""Signature checks, header rules, the body cap and error bodies; no services (the backend is a recording fake)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr
from starlette.datastructures import Headers

from producer import http as webhooks
from producer.http import Backend, Rejected, WebhookConfig, create_app, sign
from store import errors, payloads
from tests.support.http_fixtures import API_KEY, OLD_SECRET, SECRET, key, signed_headers, webhook_config

BODY = b'{"event":"order.paid","order":7}'


class Recorder:
    """Stands in for every store: any use is recorded, so a test can assert that nothing was touched."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        def record(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            raise AssertionError(f"the backend was used: {name}")

        return record


def _app(*secrets: str, recorder: Recorder | None = None) -> tuple[TestClient, Recorder]:
    recorder = recorder or Recorder()
    backend = Backend(
        deliveries=recorder,  # type: ignore[arg-type]
        checkpoints=recorder,
        approvals=recorder,  # type: ignore[arg-type]
        enqueue=recorder.enqueue,
        lease_holder=recorder.holder,
        known_agents=recorder.known,
    )
    config = WebhookConfig(
        secrets=tuple(key(s) for s in secrets or (SECRET,)), github_secrets=(b"gh",), api_key=SecretStr(API_KEY)
    )
    return TestClient(create_app(config, backend), raise_server_exceptions=False), recorder


def _verify(
    headers: dict[str, str], body: bytes = BODY, secrets: tuple[str, ...] = (SECRET,), now: float | None = None
) -> None:
    delivery_id, stamp, signatures = webhooks.standard_headers(Headers(headers))
    webhooks.check_timestamp(stamp, time.time() if now is None else now)
    webhooks.verify_standard(tuple(key(s) for s in secrets), delivery_id, stamp, body, signatures)


def _status(call: Any) -> int:
    with pytest.raises(Rejected) as caught:
        call()
    return caught.value.status


def test_a_valid_signature_is_accepted() -> None:
    _verify(signed_headers(BODY, "msg_1", int(time.time())))


def test_a_tampered_body_is_refused_as_unauthenticated() -> None:
    headers = signed_headers(BODY, "msg_1", int(time.time()))
    assert _status(lambda: _verify(headers, body=BODY.replace(b"7", b"8"))) == 401


def test_a_signature_made_with_another_secret_is_refused() -> None:
    headers = signed_headers(BODY, "msg_1", int(time.time()), secret=OLD_SECRET)
    assert _status(lambda: _verify(headers)) == 401


def test_a_signed_id_or_timestamp_cannot_be_swapped() -> None:
    now = int(time.time())
    headers = signed_headers(BODY, "msg_1", now)
    assert _status(lambda: _verify({**headers, "webhook-id": "msg_2"})) == 401
    assert _status(lambda: _verify({**headers, "webhook-timestamp": str(now - 1)})) == 401


@pytest.mark.parametrize("offset", [-301, 301, -10_000])
def test_a_timestamp_outside_five_minutes_is_refused_past_or_future(offset: int) -> None:
    now = time.time()
    headers = signed_headers(BODY, "msg_1", int(now) + offset)
    assert _status(lambda: _verify(headers, now=now)) == 401


def test_a_timestamp_just_inside_the_window_is_accepted() -> None:
    now = time.time()
    _verify(signed_headers(BODY, "msg_1", int(now) - 299), now=now)
    _verify(signed_headers(BODY, "msg_1", int(now) + 299), now=now)


@pytest.mark.parametrize("missing", ["webhook-id", "webhook-timestamp", "webhook-signature"])
def test_a_missing_header_is_a_bad_request(missing: str) -> None:
    headers = signed_headers(BODY, "msg_1", int(time.time()))
    del headers[missing]
    assert _status(lambda: _verify(headers)) == 400


def test_a_repeated_header_is_a_bad_request() -> None:
    headers = signed_headers(BODY, "msg_1", int(time.time()))
    raw = [(k.encode(), v.encode()) for k, v in headers.items()] + [(b"webhook-id", b"msg_2")]
    with pytest.raises(Rejected) as caught:
        webhooks.standard_headers(Headers(raw=raw))
    assert caught.value.status == 400


@pytest.mark.parametrize("stamp", ["", "12.5", "-5", "1e9", "abc", "9" * 13])
def test_a_malformed_timestamp_is_a_bad_request(stamp: str) -> None:
    headers = {**signed_headers(BODY, "msg_1", int(time.time())), "webhook-timestamp": stamp}
    assert _status(lambda: webhooks.standard_headers(Headers(headers))) == 400


def test_during_rotation_either_secret_verifies() -> None:
    now = int(time.time())
    _verify(signed_headers(BODY, "msg_1", now, secret=OLD_SECRET), secrets=(SECRET, OLD_SECRET))
    _verify(signed_headers(BODY, "msg_1", now, secret=SECRET), secrets=(SECRET, OLD_SECRET))


def test_one_valid_signature_among_several_is_enough() -> None:
    now = int(time.time())
    good = sign(key(SECRET), "msg_1", now, BODY)
    headers = {**signed_headers(BODY, "msg_1", now), "webhook-signature": f"v1,Zm9v v1a,xyz {good} v2,abc"}
    _verify(headers)


def test_a_signature_of_another_version_only_is_refused() -> None:
    now = int(time.time())
    good = sign(key(SECRET), "msg_1", now, BODY).removeprefix("v1,")
    headers = {**signed_headers(BODY, "msg_1", now), "webhook-signature": f"v2,{good}"}
    assert _status(lambda: _verify(headers)) == 401


def test_github_signatures_are_checked_over_the_body() -> None:
    import hashlib
    import hmac

    good = "sha256=" + hmac.new(b"gh", BODY, hashlib.sha256).hexdigest()
    webhooks.verify_github((b"gh",), good, BODY)
    flipped = good[:-1] + ("1" if good[-1] == "0" else "0")
    for bad in (flipped, "sha1=" + good[7:], "sha256=zz", ""):
        assert _status(lambda bad=bad: webhooks.verify_github((b"gh",), bad, BODY)) == 401


def test_secrets_must_be_whsec_base64() -> None:
    assert webhooks.parse_secret(SECRET) == key(SECRET)
    with pytest.raises(errors.ConfigurationError):
        webhooks.parse_secret("whsec_not base64!")
    with pytest.raises(errors.ConfigurationError):
        webhook_config(LOUSHO_WEBHOOK_SECRETS="")
    config = webhook_config(
        LOUSHO_WEBHOOK_SECRETS=f"{SECRET}, {OLD_SECRET}", LOUSHO_WEBHOOK_INPUT="desk=/request", LOUSHO_API_KEY="k"
    )
    assert config.secrets == (key(SECRET), key(OLD_SECRET)) and config.input_pointers == {"desk": "/request"}


def test_a_bad_signature_gets_401_and_touches_nothing() -> None:
    client, recorder = _app()
    headers = signed_headers(BODY, "msg_1", int(time.time()), secret=OLD_SECRET)
    response = client.post("/webhooks/hooks", content=BODY, headers=headers)
    assert response.status_code == 401
    assert response.json() == {
        "error": {"code": "LOUSHO_WEBHOOK_SIGNATURE_INVALID", "message": "signature verification failed"}
    }
    assert recorder.calls == []


def test_unsigned_and_stale_requests_touch_nothing() -> None:
    client, recorder = _app()
    assert client.post("/webhooks/hooks", content=BODY, headers={"content-type": "application/json"}).status_code == 400
    stale = signed_headers(BODY, "msg_1", int(time.time()) - 3600)
    assert client.post("/webhooks/hooks", content=BODY, headers=stale).status_code == 401
    assert recorder.calls == []


@pytest.mark.parametrize("chunked", [False, True])
def test_a_two_mib_body_gets_413_before_it_is_verified_or_parsed(
    chunked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*args: Any) -> Any:
        raise AssertionError("must not be reached")

    monkeypatch.setattr(payloads, "loads_untrusted", never)
    monkeypatch.setattr(webhooks.signatures, "verify_standard", never)
    client, recorder = _app()
    big = b'{"pad":"' + b"x" * (2 * 1024 * 1024) + b'"}'
    headers = signed_headers(big, "msg_big", int(time.time()))
    content: Any = (big[i : i + 65536] for i in range(0, len(big), 65536)) if chunked else big
    response = client.post("/webhooks/hooks", content=content, headers=headers)
    assert response.status_code == 413
    assert b"x" * 16 not in response.content
    assert recorder.calls == []


def test_a_body_that_is_not_json_is_refused_without_echo() -> None:
    client, recorder = _app()
    headers = signed_headers(BODY, "msg_1", int(time.time()))
    response = client.post("/webhooks/hooks", content=BODY, headers={**headers, "content-type": "text/plain"})
    assert response.status_code == 415
    for body in (b"{" * 10_000 + b"}" * 10_000, b'{"v": NaN}', b'{"secret-marker": ', b"[" + b"1" * 5000 + b"]"):
        response = client.post("/webhooks/hooks", content=body, headers=signed_headers(body, "msg_2", int(time.time())))
        assert response.status_code == 400, body[:20]
        assert b"secret-marker" not in response.content and b"NaN" not in response.content
    assert recorder.calls == []


def test_read_and_approval_routes_need_the_api_key() -> None:
    client, recorder = _app()
    for headers in (
        {},
        {"authorization": "Bearer wrong"},
        {"authorization": API_KEY},
        {"authorization": f"Basic {API_KEY}"},
    ):
        assert client.get("/runs/job-hooks-1", headers=headers).status_code == 401
        response = client.post(
            "/approvals/a1",
            content=json.dumps({"approved": True}),
            headers={**headers, "content-type": "application/json"},
        )
        assert response.status_code == 401
        assert response.headers["www-authenticate"] == "Bearer"
    assert recorder.calls == []


def test_an_agent_name_that_cannot_be_one_is_404_before_anything_else() -> None:
    client, recorder = _app()
    assert client.post("/webhooks/bad%20name", content=BODY).status_code == 404
    assert recorder.calls == []
