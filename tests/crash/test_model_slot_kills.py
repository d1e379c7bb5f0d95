"""A killed worker's model slots: they free within a lease TTL, and a worker's ``/metrics`` shows the fleet's slots.

Workers load ``tests.support.limited_agents`` beside the crash-test agents (``tests/crash/test_model_limits.py``).
"""

from __future__ import annotations

import socket
import time
import urllib.request
from collections.abc import Callable

import pytest
from prometheus_client import parser

from store.model_slots import RedisModelSlots
from tests.support.agents import run_input
from tests.support.cluster import Cluster, wait_until

pytestmark = pytest.mark.crash

AGENTS = "tests.support.agents,tests.support.limited_agents"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _scrape(port: int) -> list[tuple[str, dict[str, str], float]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return [
            (s.name, dict(s.labels), s.value)
            for family in parser.text_string_to_metric_families(response.read().decode())
            for s in family.samples
        ]


def _sample(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    return sum(value for found, got, value in samples if found == name and labels.items() <= got.items())


def test_killing_a_worker_that_holds_slots_frees_them_within_a_lease_ttl(make_cluster: Callable[..., Cluster]) -> None:
    # Given a worker whose two processes each hold a slot through a long model call, and a third run waiting
    port = _free_port()
    cluster = make_cluster(
        extra_env={"LOUSHO_AGENTS": AGENTS, "LOUSHO_METRICS_PORT": str(port), "LOUSHO_METRICS_DIR": ""}
    )
    cluster.extra_env["LOUSHO_METRICS_DIR"] = str(cluster.workdir / "metrics")
    worker = cluster.start_worker("w1", concurrency=3)
    cluster.start_beat()
    settings = cluster.settings()
    slots = RedisModelSlots(cluster.redis, settings.lease_ttl_ms)
    runs = [f"guarded-k{n}" for n in range(3)]

    def usage() -> tuple[int, int]:
        found = {u.key: u for u in slots.usage()}.get("crash-guarded")
        return (found.in_use, found.waiting) if found is not None else (0, 0)

    for run in runs[:2]:
        cluster.send("limited", run, run_input(run, turns=1, slowmodel="0:1500"))
    wait_until(lambda: usage()[0] == 2, 15, "two slots held")
    cluster.send("limited", runs[2], run_input(runs[2], turns=1))

    wait_until(lambda: usage() == (2, 1), 5, "two slots held and one run waiting")
    # The worker's /metrics shows the fleet's slots (read from Redis) and the wait it counted (the waiting step
    # counts it once its answer came back, a moment after Redis put the run in line)
    wait_until(
        lambda: _sample(_scrape(port), "lousho_model_limit_waits_total", key="crash-guarded", reason="slot") >= 1,
        5,
        "the wait counted",
    )
    scraped = _scrape(port)
    assert _sample(scraped, "lousho_model_slots_in_use", key="crash-guarded") == 2
    assert _sample(scraped, "lousho_model_slots_waiting", key="crash-guarded") == 1
    assert _sample(scraped, "lousho_model_limit_waits_total", key="crash-guarded", reason="slot") >= 1
    # When the whole worker is killed
    cluster.kill_group(worker)
    killed = time.monotonic()
    # Then its slots are free within one lease TTL (nobody released them: they expired)
    wait_until(lambda: usage()[0] == 0, settings.lease_ttl_ms / 1000 + 1.0, "slots freed")
    freed_after = time.monotonic() - killed
    print(
        f"slots of the killed worker freed {freed_after:.2f} s after the kill (lease TTL "
        f"{settings.lease_ttl_ms / 1000} s)"
    )
    assert freed_after <= settings.lease_ttl_ms / 1000 + 0.3
    # ... and a new worker finishes every run, the waiter included
    cluster.start_worker("w2", concurrency=2)
    cluster.wait_finished(runs, timeout=60)
