"""``lousho limits``: the model limit keys live workers give different numbers, read from the agent registry."""

from __future__ import annotations

import json

import pytest

from producer.client import Client
from store.model_limit import ModelLimit
from store.registry import PostgresAgentRegistry
from tests.support.cli_fixtures import Lousho

pytestmark = pytest.mark.integration

FINGERPRINT = {"model": "mock", "tools": {}, "instructions": "", "hash": "0"}


def test_limits_names_each_key_live_workers_disagree_on_and_the_smallest_numbers_that_hold(
    lousho: Lousho, client: Client
) -> None:
    registry = PostgresAgentRegistry(client.engine)
    # Given workers of two releases: one key given two sets of numbers, another key agreed on
    agreed = ModelLimit("anthropic", concurrent=4)
    registry.register(
        "old:1",
        {"shop": FINGERPRINT, "mail": FINGERPRINT},
        [1],
        {
            "shop": ModelLimit("openai-main", concurrent=8, requests_per_minute=500),
            "mail": agreed,
        },
    )
    registry.register(
        "new:1",
        {"shop": FINGERPRINT, "mail": FINGERPRINT},
        [1],
        {
            "shop": ModelLimit("openai-main", concurrent=6, tokens_per_minute=9000),
            "mail": agreed,
        },
    )
    registry.register(
        "new:2", {"shop": FINGERPRINT}, [1], {"shop": ModelLimit("openai-main", concurrent=6, tokens_per_minute=9000)}
    )
    # When an operator asks
    printed = lousho("limits")
    as_json = lousho("limits", "--json")
    print(f"\n{printed.out}")
    # Then the conflict is named with the workers giving each set, and what holds meanwhile (exit 3)
    assert printed.code == 3 and as_json.code == 3
    assert printed.out.splitlines() == [
        "conflict: model limit 'openai-main' is given different numbers by live workers",
        "  openai-main=concurrent:6,tpm:9000  by new:1, new:2",
        "  openai-main=concurrent:8,rpm:500  by old:1",
        "  holds meanwhile (the smallest of each): openai-main=concurrent:6,rpm:500,tpm:9000",
    ]
    [conflict] = json.loads(as_json.out)["conflicts"]
    assert conflict["holds"] == {
        "key": "openai-main",
        "concurrent": 6,
        "requests_per_minute": 500,
        "tokens_per_minute": 9000,
    }
    # And once the old release is gone, they agree (exit 0)
    registry.forget("old:1")
    agreed_now = lousho("limits")
    assert agreed_now.code == 0 and agreed_now.out.strip() == "live workers agree on every model limit they hold"
    assert client.limit_conflicts() == []
