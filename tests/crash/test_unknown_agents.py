"""A run sent to an agent name no worker ever registered (a typo, on a database no worker has registered anything in
yet, where ``send`` cannot check names) is parked with ``LOUSHO_AGENT_NOT_FOUND`` once ``LOUSHO_AGENT_GRACE_S`` has
passed since its input, by real ``celery worker`` and ``celery beat`` processes; a run of an agent some worker
registered once, which no live worker serves now, keeps waiting for the deploy (RELIABILITY I13)."""

from __future__ import annotations

import time
from collections.abc import Callable

import psycopg

from tests.support.cluster import Cluster, wait_until

GRACE_S = 3.0


def _error(cluster: Cluster, run_id: str) -> dict[str, object]:
    found = cluster.statuses([run_id]).get(run_id, {}).get("last_error")
    return found if isinstance(found, dict) else {}


def test_a_run_of_an_agent_no_worker_ever_registered_is_parked_once_the_grace_has_passed(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = make_cluster(extra_env={"LOUSHO_AGENT_GRACE_S": str(GRACE_S)})
    with psycopg.connect(cluster.database_url) as conn:
        # A worker of an earlier release served "departed" an hour ago; none serves it now.
        conn.execute(
            "INSERT INTO agents (name, seen_at) VALUES ('departed', now() - interval '1 hour')"
            " ON CONFLICT (name) DO NOTHING"
        )
    cluster.start_worker()
    cluster.start_beat()
    settings = cluster.settings()

    sent = time.monotonic()
    cluster.send("chaoz", "typo-1", "Charge order 7")
    cluster.send("departed", "deploy-1", "Charge order 7")
    limit = GRACE_S + settings.lease_ttl_ms / 1000 + 2 * settings.recover_interval_s + 3.0
    wait_until(
        lambda: _error(cluster, "typo-1").get("retryable") is False, limit + 10, "the run of the mistyped agent parked"
    )
    parked_after = time.monotonic() - sent

    error = _error(cluster, "typo-1")
    print(f"\n[unknown agent] parked after {parked_after:.1f} s (grace {GRACE_S:g} s, limit {limit:g} s)")
    assert error["code"] == "LOUSHO_AGENT_NOT_FOUND"
    assert "no worker ever has" in str(error["message"]) and "LOUSHO_AGENT_GRACE_S" in str(error["message"])
    assert GRACE_S <= parked_after <= limit
    waiting = _error(cluster, "deploy-1")
    assert waiting.get("code") == "LOUSHO_AGENT_NOT_FOUND" and waiting.get("retryable") is True
    logs = cluster.worker_logs()
    # The first step hands the run back naming the cause, unless a loaded machine ran it after the grace had passed:
    # then that step parks it at once.
    assert "handed back: no worker has registered agent 'chaoz'" in logs or "parked: LOUSHO_AGENT_NOT_FOUND" in logs
    assert "handed back: no live worker serves agent 'departed'" in logs
