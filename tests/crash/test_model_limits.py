"""A ``ModelLimit`` held across real worker processes: concurrent calls, a provider's 429 cool-down, a killed holder.

Workers load ``tests.support.limited_agents`` beside the crash-test agents: a fake provider that refuses (429,
``Retry-After: 2``) a third concurrent call on one account, counted fleet-wide in Redis.
"""

from __future__ import annotations

import os
import re
import socket
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client import parser

from store.model_slots import RedisModelSlots
from tests.support.agents import run_input
from tests.support.cluster import Cluster, wait_until
from tests.support.limited_agents import RETRY_AFTER_S

pytestmark = pytest.mark.crash

AGENTS = "tests.support.agents,tests.support.limited_agents"
#: A waiting step returns at once; anything near a model call's latency would mean it sat on a slot.
_WAIT_STEP = re.compile(r"succeeded in ([0-9.]+)s: 'waiting on a model slot'")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _scrape(port: int) -> list[tuple[str, dict[str, str], float]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return [(s.name, dict(s.labels), s.value)
                for family in parser.text_string_to_metric_families(response.read().decode()) for s in family.samples]


def _sample(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    return sum(value for found, got, value in samples if found == name and labels.items() <= got.items())


def _most_at_once(spans: list[tuple[float, float]]) -> int:
    """The largest number of spans open at one instant (an end at t closes before a start at t opens)."""
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans], key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


def _spans(events: list[dict[str, Any]], account: str) -> list[tuple[float, float]]:
    """(start, end) of each provider call on ``account`` that was answered, from the calls' own log lines."""
    starts: dict[tuple[int, str], float] = {}
    spans = []
    for event in events:
        if event.get("kind") == "model" and event.get("run_id", "").startswith(account):
            key = (event["pid"], event["call"])
            if event["phase"] == "start":
                starts[key] = event["ts"]
            elif key in starts:
                spans.append((starts.pop(key), event["ts"]))
    return spans


def _tool_spans(events: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(start, end) of each tool execution."""
    starts = {e["exec"]: e["ts"] for e in events if e.get("kind") == "tool" and e.get("phase") == "start"}
    return [(starts[e["exec"]], e["ts"]) for e in events
            if e.get("kind") == "tool" and e.get("phase") == "end" and e["exec"] in starts]


def test_two_workers_hold_a_concurrent_limit_of_two_without_blocking_a_process(
        make_cluster: Callable[..., Cluster]) -> None:
    # Given 2 workers x 2 processes and an agent whose key allows 2 concurrent calls on a provider that refuses a 3rd
    cluster = make_cluster(extra_env={"LOUSHO_AGENTS": AGENTS})
    workers = [cluster.start_worker("w1", concurrency=2, wait=False), cluster.start_worker("w2", concurrency=2,
                                                                                            wait=False)]
    for worker in workers:
        cluster.wait_ready(worker)
    cluster.start_beat()
    runs = [f"guarded-{n}" for n in range(8)]
    # When 8 runs of 3 model turns (250 ms each) and tool batches go at once
    for run in runs:
        cluster.send("limited", run, run_input(run, turns=3, calls="2", sleep="100-200", model=250))
    cluster.wait_finished(runs, timeout=60)
    # Then: at most 2 model calls overlapped at any instant, the provider refused none, every run finished unparked
    events = cluster.events()
    spans = _spans(events, "guarded-")
    refused = [e for e in events if e.get("kind") == "provider" and e.get("phase") == "refused"]
    statuses = cluster.statuses(runs)
    overlap = _most_at_once(spans)
    outcomes = cluster.outcomes()
    wait_steps = [float(t) for t in _WAIT_STEP.findall(cluster.worker_logs())]
    # Tool calls of other runs ran while both slots were taken: no process sat on a slot meanwhile.
    tools_beside = sum(1 for tool_start, tool_end in _tool_spans(events) if any(
        sum(1 for start, end in spans if start <= instant < end) == 2
        for instant in (tool_start + (tool_end - tool_start) * k / 20 for k in range(21))))
    print(f"model calls: {len(spans)}, most at once: {overlap}, refused: {len(refused)}, waits: "
          f"{outcomes['waiting']} (longest {max(wait_steps, default=0):.3f} s), tool calls beside 2 model calls: "
          f"{tools_beside}")
    assert len(spans) == 3 * len(runs)
    assert overlap <= 2 and refused == []
    assert all(s["status"] == "finished" and s["last_error"] is None for s in statuses.values()), statuses
    assert outcomes["waiting"] > 0 and outcomes["parked"] == 0
    assert max(wait_steps) < 0.5, wait_steps
    assert tools_beside > 0


def test_a_429_with_retry_after_holds_every_caller_of_the_key(make_cluster: Callable[..., Cluster]) -> None:
    # Given a key with no numbers (nothing holds calls back) on the provider that refuses a 3rd concurrent call
    cluster = make_cluster(extra_env={"LOUSHO_AGENTS": AGENTS})
    cluster.start_worker("w1", concurrency=4)
    cluster.start_beat()
    runs = [f"open-{n}" for n in range(4)]
    # When 4 runs call it at once, so some calls are refused
    for run in runs:
        cluster.send("unguarded", run, run_input(run, turns=1, model=300))
    cluster.wait_finished(runs, timeout=60)
    # Then each refusal cooled the key down: no request reached the provider until its Retry-After passed
    events = [e for e in cluster.events() if e.get("kind") == "provider"]
    refusals = [e["ts"] for e in events if e["phase"] == "refused"]
    requests = [e["ts"] for e in events if e["phase"] in ("start", "refused")]
    # The cool-down is written once the refused step hears the 429 (a few ms later): requests past their own
    # admission by then may still arrive, so the window starts 0.2 s after the refusal.
    inside = [(r, t) for r in refusals for t in requests if r + 0.2 < t < r + RETRY_AFTER_S - 0.05]
    statuses = cluster.statuses(runs)
    print(f"requests: {len(requests)}, refused: {len(refusals)}, requests inside a cool-down: {len(inside)}")
    assert refusals, "the provider refused nothing: the test did not test the cool-down"
    assert inside == []
    assert all(s["status"] == "finished" and s["last_error"] is None for s in statuses.values()), statuses


def test_killing_a_worker_that_holds_slots_frees_them_within_a_lease_ttl(make_cluster: Callable[..., Cluster]) -> None:
    # Given a worker whose two processes each hold a slot through a long model call, and a third run waiting
    port = _free_port()
    cluster = make_cluster(extra_env={"LOUSHO_AGENTS": AGENTS, "LOUSHO_METRICS_PORT": str(port),
                                      "LOUSHO_METRICS_DIR": ""})
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
    # The worker's /metrics shows the fleet's slots (read from Redis) and the wait it counted
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
    print(f"slots of the killed worker freed {freed_after:.2f} s after the kill (lease TTL "
          f"{settings.lease_ttl_ms / 1000} s)")
    assert freed_after <= settings.lease_ttl_ms / 1000 + 0.3
    # ... and a new worker finishes every run, the waiter included
    cluster.start_worker("w2", concurrency=2)
    cluster.wait_finished(runs, timeout=60)


#: Key A's backlog: 20 runs in CI (about 5 s); a benchmark by hand sets ``LOUSHO_FAIRNESS_RUNS`` (say 200).
FAIRNESS_RUNS = int(os.environ.get("LOUSHO_FAIRNESS_RUNS") or 20)


def test_one_keys_backlog_does_not_starve_another_keys_run(make_cluster: Callable[..., Cluster]) -> None:
    # Given 2 workers x 2 processes and a limit of 2 concurrent calls, with key A's backlog queued first
    cluster = make_cluster(extra_env={"LOUSHO_AGENTS": AGENTS})
    workers = [cluster.start_worker(name, concurrency=2, wait=False) for name in ("w1", "w2")]
    for worker in workers:
        cluster.wait_ready(worker)
    cluster.start_beat()
    shop = cluster.client.agent("limited")
    backlog = [f"guarded-a{n}" for n in range(FAIRNESS_RUNS)]
    for run in backlog:
        shop.send(run_input(run, turns=1, model=250), session_id=run, check_agent=False, fairness_key="tenant-a")
    # When key B's one run is sent after all of them
    shop.send(run_input("guarded-b", turns=1, model=250), session_id="guarded-b", check_agent=False,
              fairness_key="tenant-b")
    cluster.wait_finished([*backlog, "guarded-b"], timeout=30 + FAIRNESS_RUNS * 0.5)
    # Then B's model call started before A's tenth run finished
    events = [e for e in cluster.events() if e.get("kind") == "model"]
    b_start = min(e["ts"] for e in events if e["run_id"] == "guarded-b" and e["phase"] == "start")
    a_ends = sorted(e["ts"] for e in events if e["run_id"].startswith("guarded-a") and e["phase"] == "end")
    first = min(e["ts"] for e in events if e["phase"] == "start")
    before = sum(1 for end in a_ends if end < b_start)
    print(f"fairness: {FAIRNESS_RUNS} runs of key A queued first; B's model call started {b_start - first:.2f} s"
          f" after the first call, after {before} of A's runs finished (A's tenth finished at"
          f" {a_ends[9] - first:.2f} s, its last at {a_ends[-1] - first:.2f} s)")
    assert b_start < a_ends[9]
