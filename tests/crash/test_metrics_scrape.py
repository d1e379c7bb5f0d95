"""A scrape of ``/metrics`` after real runs shows every family with the count the runs' own records give.

One ``celery worker`` with two prefork pool processes serves ``LOUSHO_METRICS_PORT`` from its parent, so the
figures are the sum of both processes' files. The runs: finished ones, one paused on an approval, one parked by
its provider, one aborted, a busy duplicate, a stalled holder fenced out and recovered by the sweep, schedules
that fire, skip and miss, and webhook deliveries sent to the HTTP app in this process (scraped at its own
``/metrics``). Each expected figure comes from a record that does not go through the metrics: the worker's
``advance ... -> <outcome>`` and sweep log lines, the agents' side-effect logs, the fake provider's usage,
and Postgres rows.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from fastapi.testclient import TestClient

from producer.http import Backend, WebhookConfig, create_app, sign
from store import metrics
from tests.fakes.provider_server import FakeProviderServer
from tests.support import abort_agents, weather_agents
from tests.support.agents import run_input
from tests.support.cluster import Cluster, wait_until

pytest.importorskip("openai")
parser = pytest.importorskip("prometheus_client.parser")

MODULES = "tests.support.agents,tests.support.abort_agents,tests.support.weather_agents"
WEBHOOK_KEY = b"lousho-metrics-secret-0123456789"
#: The ``weather`` agent's model as steps name it (provider and model id).
PROVIDER_MODEL = "openai:gpt-test"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture
def provider() -> Iterator[tuple[FakeProviderServer, weather_agents.WeatherScript]]:
    server = FakeProviderServer().start()
    script = weather_agents.WeatherScript()
    server.script = script
    try:
        yield server, script
    finally:
        server.stop()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _parse(body: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in parser.text_string_to_metric_families(body)
        for s in family.samples
    }


def _scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return _parse(response.read().decode())


def _sum(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    wanted = set(labels.items())
    return sum(v for (n, got), v in samples.items() if n == name and wanted <= got)


def _by(samples: Samples, name: str, label: str) -> dict[str, float]:
    """``name``'s non-zero samples summed by one label."""
    found: dict[str, float] = {}
    for (n, got), v in samples.items():
        if n == name and v:
            key = dict(got).get(label, "")
            found[key] = found.get(key, 0.0) + v
    return found


def _rows(cluster: Cluster, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(cluster.database_url) as conn:
        return conn.execute(sql, args).fetchall()


def _status(cluster: Cluster, session_id: str) -> tuple[str, Any]:
    rows = _rows(cluster, "SELECT status, last_error FROM runs WHERE session_id = %s", session_id)
    return (rows[0][0], rows[0][1]) if rows else ("missing", None)


def _log_sum(cluster: Cluster, marker: str, index: int = 0) -> int:
    """The sum of the ``index``-th number of each worker log line containing ``marker``."""
    total = 0
    for line in cluster.worker_logs().splitlines():
        if marker in line:
            numbers = [int(word) for word in line.split(marker, 1)[1].replace(",", " ").split() if word.isdigit()]
            total += numbers[index]
    return total


def _headers(body: bytes, delivery_id: str, key: bytes = WEBHOOK_KEY) -> dict[str, str]:
    stamp = int(time.time())
    return {
        "content-type": "application/json",
        "webhook-id": delivery_id,
        "webhook-timestamp": str(stamp),
        "webhook-signature": sign(key, delivery_id, stamp, body),
    }


def _weather_events(path: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in weather_agents.read_events(path) if e.get("kind") == kind]


def _expected(cluster: Cluster, weather_log: Path) -> dict[str, Any]:
    """The figures the runs' own records give (worker logs, side-effect logs, Postgres)."""
    events = cluster.events()
    tool_ends = [e for e in events if e.get("kind") == "tool" and e.get("phase") == "end"]
    model_ends = [e for e in events if e.get("kind") == "model" and e.get("phase") == "end"]
    abort_models = [e for e in events if e.get("kind") == "model" and "phase" not in e]
    provider = Counter(e["outcome"] for e in _weather_events(weather_log, "provider") if e.get("phase") == "end")
    # inbox_head numbers the inputs a run was sent (the inbox rows go once merged).
    inputs = dict(_rows(cluster, "SELECT agent, sum(inbox_head) FROM runs GROUP BY agent"))
    finished = dict(
        _rows(
            cluster,
            "SELECT agent, count(*) FROM runs WHERE status = 'finished'"
            " AND NOT COALESCE((document ->> 'aborted')::boolean, false) GROUP BY agent",
        )
    )
    fires = dict(_rows(cluster, "SELECT outcome, count(*) FROM schedule_fires GROUP BY outcome"))
    return {
        "outcomes": dict(cluster.outcomes()),
        "inputs": {str(k): int(v) for k, v in inputs.items()},
        "finished_chaos": int(finished.get("chaos", 0)),
        "mock_calls": len(model_ends),
        "abort_calls": len(abort_models),
        "provider_ok": provider["ok"],
        "provider_failed": sum(provider.values()) - provider["ok"],
        "work": sum(1 for e in tool_ends if not e.get("approved") and e.get("ms") is None and "cancelled" not in e),
        "approved_work": sum(1 for e in tool_ends if e.get("approved")),
        "slow": sum(1 for e in tool_ends if "cancelled" in e),
        "forecast": len([e for e in _weather_events(weather_log, "tool") if e.get("phase") == "start"]),
        "resends": _log_sum(cluster, "recover: re-enqueued "),
        "fires": _log_sum(cluster, "schedules: ", 0),
        "skips": _log_sum(cluster, "schedules: ", 1),
        "misses": _log_sum(cluster, "schedules: ", 2),
        "fires_table": int(fires.get("fired", 0)),
        "skips_table": int(fires.get("skipped", 0)),
    }


def _compare(expected: dict[str, Any], got: Samples, parked_code: str) -> list[str]:
    problems: list[str] = []

    def check(what: str, actual: float, wanted: float) -> None:
        if actual != wanted:
            problems.append(f"{what}: scraped {actual}, expected {wanted}")

    outcomes: dict[str, int] = expected["outcomes"]
    scraped_outcomes = _by(got, "lousho_steps_total", "outcome")
    for outcome in sorted(set(outcomes) | set(scraped_outcomes)):
        check(f"{outcome} steps", scraped_outcomes.get(outcome, 0), outcomes.get(outcome, 0))
    check(
        "timed steps",
        _sum(got, "lousho_step_duration_seconds_count"),
        sum(v for k, v in outcomes.items() if k not in metrics.UNTIMED),
    )
    for agent, count in expected["inputs"].items():
        check(f"runs started by {agent}", _sum(got, "lousho_runs_started_total", agent=agent), count)
    check(
        "runs finished by chaos",
        _sum(got, "lousho_runs_finished_total", agent="chaos", finish_reason="stop"),
        expected["finished_chaos"],
    )
    check("runs finished by weather", _sum(got, "lousho_runs_finished_total", agent="weather"), 1)
    check("runs awaiting approval", _sum(got, "lousho_runs_awaiting_approval_total", agent="chaos"), 1)
    check("runs parked", _sum(got, "lousho_runs_parked_total", agent="weather", code=parked_code), 1)
    check("runs parked, all", _sum(got, "lousho_runs_parked_total"), outcomes.get("parked", 0))
    check("runs aborted", _sum(got, "lousho_runs_aborted_total", agent=abort_agents.AGENT), 1)
    check("fenced saves", _sum(got, "lousho_fenced_saves_total", agent="chaos"), outcomes.get("fenced", 0))
    check("busy drops", _sum(got, "lousho_busy_drops_total"), outcomes.get("busy", 0))
    check(
        "mock model calls",
        _sum(got, "lousho_model_calls_total", model="crash-mock", outcome="ok"),
        expected["mock_calls"],
    )
    check(
        "abort model calls",
        _sum(got, "lousho_model_calls_total", model="abort-mock", outcome="ok"),
        expected["abort_calls"],
    )
    check(
        "provider calls",
        _sum(got, "lousho_model_calls_total", model=PROVIDER_MODEL, outcome="ok"),
        expected["provider_ok"],
    )
    check("provider errors", _sum(got, "lousho_model_errors_total", model=PROVIDER_MODEL), expected["provider_failed"])
    check(
        "provider input tokens",
        _sum(got, "lousho_model_tokens_total", model=PROVIDER_MODEL, direction="input"),
        10 * expected["provider_ok"],
    )
    check(
        "provider output tokens",
        _sum(got, "lousho_model_tokens_total", model=PROVIDER_MODEL, direction="output"),
        5 * expected["provider_ok"],
    )
    for tool in ("work", "approved_work", "slow", "forecast"):
        check(f"{tool} calls", _sum(got, "lousho_tool_calls_total", tool=tool), expected[tool])
        check(f"{tool} timings", _sum(got, "lousho_tool_duration_seconds_count", tool=tool), expected[tool])
    check("sweep re-sends", _sum(got, "lousho_sweep_resends_total"), expected["resends"])
    check("schedule fires", _sum(got, "lousho_schedule_fires_total"), expected["fires"])
    check("schedule fires, claimed", _sum(got, "lousho_schedule_fires_total"), expected["fires_table"])
    check("schedule skips", _sum(got, "lousho_schedule_skips_total"), expected["skips"])
    check("schedule skips, claimed", _sum(got, "lousho_schedule_skips_total"), expected["skips_table"])
    check("schedule misses", _sum(got, "lousho_schedule_misses_total"), expected["misses"])
    return problems


def _figures(got: Samples) -> str:
    lines = []
    for family in metrics.FAMILIES:
        name = family if not family.endswith("_seconds") or "approval" in family else family + "_count"
        rows = sorted((sorted(labels), value) for (n, labels), value in got.items() if n == name and value)
        if not rows:
            lines.append(f"  {name}: 0")
        for labels, value in rows:
            shown = ",".join(f"{k}={v}" for k, v in labels)
            lines.append(f"  {name}{{{shown}}} {value:g}")
    return "\n".join(lines)


def test_a_scrape_after_real_runs_shows_every_family_with_the_expected_counts(
    make_cluster: Callable[..., Cluster], provider: tuple[FakeProviderServer, weather_agents.WeatherScript]
) -> None:
    server, _ = provider
    port = _free_port()
    # The I19 checker looks every second, so its gauges are in the scrape too.
    cluster = make_cluster(
        extra_env={
            "LOUSHO_AGENTS": MODULES,
            weather_agents.URL_ENV: server.openai_url,
            "LOUSHO_METRICS_PORT": str(port),
            "LOUSHO_DOCTOR_INTERVAL_S": "1",
        }
    )
    weather_log = cluster.workdir / "weather.jsonl"
    folder = cluster.workdir / "metrics"
    cluster.extra_env.update({weather_agents.LOG_ENV: str(weather_log), "LOUSHO_METRICS_DIR": str(folder)})
    worker = cluster.start_worker(concurrency=2)
    cluster.start_beat()
    wait_until(lambda: _answers(port), 15, "the worker's metrics port")
    abortable = cluster.client.agent(abort_agents.AGENT)

    # Given runs that finish, one paused on an approval, one aborted, one parked by its provider
    finishing = ["m-ok-1", "m-ok-2", "m-ok-3"]
    for run_id in finishing:
        cluster.send("chaos", run_id, run_input(run_id, turns=3, calls="2,1", sleep="10-30", model=20))
    cluster.send("chaos", "m-gate", run_input("m-gate", turns=2, calls="2", gate="0.1", sleep="10-20", model=20))
    cluster.send("weather", "m-weather", weather_agents.ask("m-weather", turns=2, ms=10))
    cluster.send(abort_agents.AGENT, "m-abort", abort_agents.ask("m-abort", calls=1, ms=20_000))
    cluster.wait_event(lambda e: e.get("kind") == "tool" and e.get("run_id") == "m-abort", what="the slow call")
    assert abortable.abort("m-abort")
    cluster.wait_finished([*finishing, "m-weather"], timeout=30)
    wait_until(lambda: _status(cluster, "m-gate")[0] == "awaiting-approval", 20, "m-gate to pause")
    paused_at = time.time()
    cluster.client.agent("weather").send("poison pill", session_id="m-weather", check_agent=False)
    wait_until(lambda: bool((_status(cluster, "m-weather")[1] or {}).get("code")), 20, "m-weather to park")
    wait_until(lambda: cluster.outcomes()["aborted"] == 1, 20, "m-abort to end aborted")

    # And a duplicate step while the run's holder works (busy), then a holder stalled past its lease (fenced)
    cluster.send("chaos", "m-busy", run_input("m-busy", turns=2, calls="1", sleep="10-20", slowmodel="0:2000"))
    cluster.wait_event(lambda e: e.get("kind") == "model" and e.get("run_id") == "m-busy", what="m-busy's model call")
    cluster.client.enqueuer.advance("m-busy")
    wait_until(lambda: cluster.outcomes()["busy"] >= 1, 10, "a busy drop")
    cluster.send("chaos", "m-zombie", run_input("m-zombie", slow="1.0:2500", sleep="20-60"))
    slow = cluster.wait_event(
        lambda e: (
            e.get("kind") == "tool"
            and e.get("phase") == "start"
            and e.get("run_id") == "m-zombie"
            and str(e["tool_call_id"]).startswith("c1-0-")
        ),
        what="the slow call of m-zombie",
    )
    wait_until(lambda: cluster.statuses(["m-zombie"])["m-zombie"]["seq"] >= 6, 10, "m-zombie's fast results")
    zombie = int(slow["pid"])
    cluster.stop(zombie)
    try:
        time.sleep(6.0)  # 3x the lease TTL: the sweep re-sends the run and the other pool process takes it
    finally:
        cluster.resume(zombie)
    wait_until(lambda: cluster.outcomes()["fenced"] >= 1, 15, "the stalled holder's refused save")
    cluster.wait_finished(["m-busy", "m-zombie"], timeout=30)

    # And schedules: one firing every second with runs longer than that (skips), one far behind (misses)
    cluster.client.schedules.create(
        "m-every",
        "chaos",
        run_input("m-sched", turns=2, calls="1", model=700),
        every=1,
        overlap="skip",
        check_agent=False,
    )
    cluster.client.schedules.create(
        "m-late", "chaos", run_input("m-late", turns=1), every=3600, catch_up="skip", check_agent=False
    )
    with psycopg.connect(cluster.database_url, autocommit=True) as conn:
        conn.execute("UPDATE schedules SET next_fire_at = now() - interval '5 hours' WHERE name = 'm-late'")
    wait_until(
        lambda: (
            _log_sum(cluster, "schedules: ", 1) >= 1
            and _log_sum(cluster, "schedules: ", 2) >= 1
            and _log_sum(cluster, "schedules: ", 0) >= 2
        ),
        20,
        "fired, skipped and missed ticks",
    )
    cluster.client.schedules.pause("m-every")
    cluster.client.schedules.pause("m-late")

    # And webhook deliveries to the HTTP app in this process: two accepted, one again, one badly signed
    config = WebhookConfig(secrets=(WEBHOOK_KEY,), input_pointers={"chaos": "/text"})
    app = create_app(config, Backend.from_client(cluster.client))
    with TestClient(app) as http:
        for n in (1, 2):
            body = json.dumps({"text": run_input(f"m-hook-{n}", turns=1)}).encode()
            assert http.post("/webhooks/chaos", content=body, headers=_headers(body, f"m-hook-{n}")).status_code == 202
        again = json.dumps({"text": run_input("m-hook-1", turns=1)}).encode()
        assert http.post("/webhooks/chaos", content=again, headers=_headers(again, "m-hook-1")).json()["duplicate"]
        forged = _headers(again, "m-hook-3", key=b"not-the-secret-0123456789abcdefg")
        assert http.post("/webhooks/chaos", content=again, headers=forged).status_code == 401
        scraped = http.get("/metrics")
        assert scraped.status_code == 200, f"the HTTP app serves no /metrics: {scraped.status_code}"
        served = _parse(scraped.text)
    print(f"\nHTTP app /metrics:\n{_figures(served)}")
    assert _sum(served, "lousho_webhook_deliveries_total", agent="chaos", result="accepted") == 2
    assert _sum(served, "lousho_webhook_deliveries_total", result="duplicate") == 1
    assert _sum(served, "lousho_webhook_deliveries_total", result="refused") == 1
    assert _sum(served, "lousho_approvals_waiting") == 1

    # Then the approval waits in both scrapes, aged since the run paused; deciding it empties the gauges
    waiting = _scrape(port)
    age = _sum(waiting, "lousho_approval_oldest_age_seconds")
    assert _sum(waiting, "lousho_approvals_waiting") == 1
    assert 0 < age <= time.time() - paused_at + 5, age
    assert cluster.approve_pending("chaos") == 1
    schedule_runs = [r[0] for r in _rows(cluster, "SELECT session_id FROM runs WHERE agent = 'chaos'")]
    cluster.wait_finished(["m-gate", *schedule_runs], timeout=40)
    wait_until(lambda: _sum(_scrape(port), "lousho_approvals_waiting") == 0, 5, "no approval waiting")

    # And every family matches the runs' own records, summed over both pool processes
    deadline = time.monotonic() + 15
    while True:
        expected = _expected(cluster, weather_log)
        got = _scrape(port)
        parked_code = str(_status(cluster, "m-weather")[1]["code"])
        problems = _compare(expected, got, parked_code)
        if not problems or time.monotonic() > deadline:
            break
        time.sleep(0.5)  # a step's metrics land a moment before its log line
    print(f"\nworker /metrics (2 pool processes):\n{_figures(got)}\nexpected from the records: {expected}")
    assert not problems, "\n".join(problems)
    wait_until(
        lambda: any(name == "lousho_runs_unexplained" for name, _ in _scrape(port)), 10, "the checker's first look"
    )
    exposed = {name for name, _ in _scrape(port)} | {name for name, _ in got} | {name for name, _ in served}
    # No call of these runs is a ``once`` call cut by a crash, so no reconciliation is counted here: that counter is
    # checked by tests/unit/test_metrics.py and the once crash tests.
    unexercised = {"lousho_tool_reconciliations_total"}
    # No agent here has a model limit: its families are scraped from a worker by tests/crash/test_model_limits.py
    # and counted by tests/unit/test_metrics.py.
    unexercised |= {f for f in metrics.FAMILIES if f.startswith(("lousho_model_limit", "lousho_model_slots"))}
    missing = [f for f in metrics.FAMILIES if f not in unexercised and not any(n.startswith(f) for n in exposed)]
    assert not missing, missing
    # Every unfinished run here (the paused one) has a waiter: the checker found none unexplained.
    assert _sum(_scrape(port), "lousho_runs_unexplained") == 0
    assert _sum(got, "lousho_approval_oldest_age_seconds") == 0
    for name in (
        "lousho_busy_drops_total",
        "lousho_fenced_saves_total",
        "lousho_sweep_resends_total",
        "lousho_schedule_fires_total",
        "lousho_schedule_skips_total",
        "lousho_schedule_misses_total",
        "lousho_runs_parked_total",
        "lousho_runs_aborted_total",
        "lousho_model_errors_total",
    ):
        assert _sum(got, name) >= 1, f"{name} was never exercised"
    # Both pool processes counted: each wrote its own file, and both ran steps
    children = {int(p.stem.split("_")[-1]) for p in folder.glob("counter_*.db")} - {worker.pid}
    step_pids = {e["pid"] for e in cluster.events() if e.get("kind") == "tool"}
    print(f"counter files of {len(children)} pool processes; tool calls ran in {len(step_pids)} processes")
    assert len(children) >= 2 and len(step_pids) >= 2


def _answers(port: int) -> bool:
    try:
        _scrape(port)
    except OSError:
        return False
    return True
