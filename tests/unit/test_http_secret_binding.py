"""Secrets bound to agents: parsed in one place, a bound secret verifies only its agent's path; no services."""

from __future__ import annotations

import base64
import hashlib
import hmac
import time

import pytest
from fastapi.testclient import TestClient

from producer.http import Backend, WebhookConfig, create_app
from store import errors
from tests.support.http_fixtures import OLD_SECRET, SECRET, key, signed_headers, webhook_config
from tests.unit.test_http_signatures import Recorder

SHOP = "whsec_" + base64.b64encode(b"shop-only-secret-0123456789abcdef").decode()
BILLING = "whsec_" + base64.b64encode(b"billing-only-secret-0123456789ab").decode()
BODY = b'{"event":"order.paid","order":7}'


def _config(**env: str) -> WebhookConfig:
    return webhook_config(**env)


def _github(secret: bytes, body: bytes = BODY) -> dict[str, str]:
    return {
        "content-type": "application/json",
        "x-github-delivery": "72d3162e-cc78-11e3-81ab-4c9367dc0958",
        "x-hub-signature-256": "sha256=" + hmac.new(secret, body, hashlib.sha256).hexdigest(),
    }


def test_bound_unbound_and_mixed_forms_are_parsed() -> None:
    config = _config(
        LOUSHO_WEBHOOK_SECRETS=f"shop={SHOP}, billing={BILLING},{SECRET}, shop={OLD_SECRET}",
        LOUSHO_GITHUB_WEBHOOK_SECRETS="shop=gh-shop, gh-any, *=gh=with=equals",
    )
    assert config.secrets == (key(SECRET),)
    assert config.agent_secrets == {"shop": (key(SHOP), key(OLD_SECRET)), "billing": (key(BILLING),)}
    assert config.standard_keys("shop") == (key(SECRET), key(SHOP), key(OLD_SECRET))
    assert config.standard_keys("billing") == (key(SECRET), key(BILLING))
    assert config.standard_keys("other") == (key(SECRET),)
    assert config.github_secrets == (b"gh-any", b"gh=with=equals")
    assert config.github_keys("shop") == (b"gh-any", b"gh=with=equals", b"gh-shop")
    unbound = _config(LOUSHO_WEBHOOK_SECRETS=f"{SECRET},{OLD_SECRET}")
    assert unbound.secrets == (key(SECRET), key(OLD_SECRET)) and not unbound.agent_secrets


def test_only_bound_secrets_are_a_usable_configuration() -> None:
    config = _config(LOUSHO_WEBHOOK_SECRETS=f"shop={SHOP}")
    assert config.standard_keys("shop") == (key(SHOP),) and config.standard_keys("billing") == ()


@pytest.mark.parametrize(
    ("variable", "value", "named"),
    [
        ("LOUSHO_WEBHOOK_SECRETS", "whsec_not base64 at-all-SECRETPART", "item 1"),
        ("LOUSHO_WEBHOOK_SECRETS", f"shop={SHOP},billing=whsec_SECRETPART!!", "agent 'billing'"),
        ("LOUSHO_WEBHOOK_SECRETS", "shop=whsec_", "agent 'shop'"),
        ("LOUSHO_WEBHOOK_SECRETS", "bad name=whsec_SECRETPARTc2VjcmV0", "item 1"),
        ("LOUSHO_GITHUB_WEBHOOK_SECRETS", "shop=", "agent 'shop'"),
        ("LOUSHO_GITHUB_WEBHOOK_SECRETS", "gh-one,*=", "item 2"),
    ],
)
def test_a_malformed_secret_names_the_variable_and_never_echoes_the_secret(
    variable: str, value: str, named: str
) -> None:
    with pytest.raises(errors.ConfigurationError) as caught:
        _config(**{variable: value})
    message = str(caught.value)
    print(f"  {variable}={value!r:50} -> {message}")
    assert variable in message and named in message
    assert "SECRETPART" not in message and SHOP.removeprefix("whsec_") not in message


def test_no_secret_at_all_is_refused() -> None:
    with pytest.raises(errors.ConfigurationError, match="LOUSHO_WEBHOOK_SECRETS"):
        _config(LOUSHO_WEBHOOK_SECRETS=" , ")


def _app(config: WebhookConfig) -> tuple[TestClient, Recorder]:
    recorder = Recorder()
    backend = Backend(
        deliveries=recorder,  # type: ignore[arg-type]
        checkpoints=recorder,
        approvals=recorder,  # type: ignore[arg-type]
        enqueue=recorder.enqueue,
        lease_holder=recorder.holder,
        known_agents=recorder.known,
    )
    return TestClient(create_app(config, backend), raise_server_exceptions=False), recorder


def test_a_signature_valid_only_under_another_agents_secret_gets_401_and_touches_nothing() -> None:
    client, recorder = _app(
        _config(LOUSHO_WEBHOOK_SECRETS=f"shop={SHOP},billing={BILLING}", LOUSHO_GITHUB_WEBHOOK_SECRETS="shop=gh-shop")
    )
    now = int(time.time())
    for agent, secret in (("billing", SHOP), ("shop", BILLING), ("other", SHOP), ("other", BILLING)):
        response = client.post(f"/webhooks/{agent}", content=BODY, headers=signed_headers(BODY, "msg_1", now, secret))
        assert response.status_code == 401, (agent, response.text)
        assert response.json()["error"]["code"] == "LOUSHO_WEBHOOK_SIGNATURE_INVALID"
    for agent in ("billing", "other"):
        assert client.post(f"/webhooks/{agent}", content=BODY, headers=_github(b"gh-shop")).status_code == 401
    assert recorder.calls == []
