"""The Prometheus sink (``store.metrics``): what each step report and count adds, multiprocess mode, the dashboard."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry
from sqlalchemy import create_engine

from store import errors, metrics, telemetry
from store.memory import MemoryModelSlots
from store.model_limit import ModelLimit
from store.settings import Settings
from store.telemetry import ModelCallRecord, StepReport, ToolCallRecord

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "lousho.json"


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def sink(registry: CollectorRegistry) -> metrics.Metrics:
    return metrics.Metrics(registry)


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    found = registry.get_sample_value(name, labels)
    return 0.0 if found is None else found


def report(
    outcome: str,
    *,
    agent: str | None = "support",
    kind: str = telemetry.MODEL_TURN,
    seconds: float = 0.25,
    **fields: object,
) -> StepReport:
    made = StepReport(
        session_id="run-1",
        agent=agent,
        kind=kind,
        outcome=outcome,
        started_ns=1_000_000_000,
        ended_ns=1_000_000_000 + int(seconds * 1e9),
    )
    for name, field_value in fields.items():
        setattr(made, name, field_value)
    return made


def test_a_step_that_starts_and_finishes_an_input_counts_both_its_calls_and_its_duration(
    sink: metrics.Metrics, registry: CollectorRegistry
) -> None:
    step = report(
        "finished",
        input_started=True,
        ended_as="finished",
        finish_reason="stop",
        model_calls=[ModelCallRecord("gpt-x", 0, 1, input_tokens=120, output_tokens=30)],
        tool_calls=[
            ToolCallRecord("lookup", "c1", "ok", 0, 500_000_000),
            ToolCallRecord("lookup", "c2", "timeout", 0, 2_000_000_000),
        ],
    )

    sink.step_done(step)

    assert value(registry, "lousho_runs_started_total", agent="support") == 1
    assert value(registry, "lousho_runs_finished_total", agent="support", finish_reason="stop") == 1
    assert value(registry, "lousho_steps_total", agent="support", kind="model turn", outcome="finished") == 1
    assert value(registry, "lousho_step_duration_seconds_count", agent="support", kind="model turn") == 1
    assert value(registry, "lousho_step_duration_seconds_sum", agent="support", kind="model turn") == 0.25
    assert value(registry, "lousho_model_calls_total", model="gpt-x", outcome="ok") == 1
    assert value(registry, "lousho_model_tokens_total", model="gpt-x", direction="input") == 120
    assert value(registry, "lousho_model_tokens_total", model="gpt-x", direction="output") == 30
    assert value(registry, "lousho_tool_calls_total", tool="lookup", outcome="ok") == 1
    assert value(registry, "lousho_tool_calls_total", tool="lookup", outcome="timeout") == 1
    assert value(registry, "lousho_tool_duration_seconds_sum", tool="lookup", outcome="timeout") == 2.0
    assert value(registry, "lousho_tool_duration_seconds_bucket", tool="lookup", outcome="ok", le="0.5") == 1
    assert value(registry, "lousho_runs_awaiting_approval_total", agent="support") == 0


@pytest.mark.parametrize(
    ("step", "family", "labels"),
    [
        (
            report("awaiting-approval", ended_as="awaiting-approval", approvals=2),
            "lousho_runs_awaiting_approval_total",
            {"agent": "support"},
        ),
        (
            report("parked", error_code="LOUSHO_PROVIDER_ERROR"),
            "lousho_runs_parked_total",
            {"agent": "support", "code": "LOUSHO_PROVIDER_ERROR"},
        ),
        (report("aborted", ended_as="aborted"), "lousho_runs_aborted_total", {"agent": "support"}),
        (report("fenced", kind=telemetry.TOOL_BATCH), "lousho_fenced_saves_total", {"agent": "support"}),
        (report("busy", agent=None), "lousho_busy_drops_total", {}),
        (
            report("finished", ended_as="budget-exceeded", finish_reason="budget-exceeded"),
            "lousho_runs_finished_total",
            {"agent": "support", "finish_reason": "budget-exceeded"},
        ),
    ],
)
def test_each_way_a_step_ends_is_counted_once_in_its_family(
    sink: metrics.Metrics, registry: CollectorRegistry, step: StepReport, family: str, labels: dict[str, str]
) -> None:
    sink.step_done(step)

    assert value(registry, family, **labels) == 1
    others = {
        "lousho_runs_awaiting_approval_total",
        "lousho_runs_parked_total",
        "lousho_runs_aborted_total",
        "lousho_fenced_saves_total",
        "lousho_busy_drops_total",
        "lousho_runs_finished_total",
        "lousho_runs_started_total",
    } - {family}
    counted = {
        f.name + "_total" for f in registry.collect() for s in f.samples if s.name.endswith("_total") and s.value
    }
    assert not counted & others, counted


def test_a_parked_step_without_a_code_and_a_step_that_raised_get_placeholder_labels(
    sink: metrics.Metrics, registry: CollectorRegistry
) -> None:
    sink.step_done(report("parked", agent=None))
    sink.step_done(StepReport(session_id="run-2"))

    assert value(registry, "lousho_runs_parked_total", agent="unknown", code="LOUSHO_UNKNOWN") == 1
    assert value(registry, "lousho_steps_total", agent="unknown", kind="model turn", outcome="error") == 1


@pytest.mark.parametrize("outcome", ["busy", "stale", "unknown", "idle", "handed-back"])
def test_steps_that_did_no_work_are_counted_but_not_timed(
    sink: metrics.Metrics, registry: CollectorRegistry, outcome: str
) -> None:
    sink.step_done(report(outcome))

    assert value(registry, "lousho_steps_total", agent="support", kind="model turn", outcome=outcome) == 1
    assert value(registry, "lousho_step_duration_seconds_count", agent="support", kind="model turn") == 0


def test_failed_and_cancelled_model_calls_are_told_apart_and_only_failures_count_as_errors(
    sink: metrics.Metrics, registry: CollectorRegistry
) -> None:
    sink.step_done(
        report(
            "failed",
            model_calls=[
                ModelCallRecord("gpt-x", 0, 1, error="LOUSHO_PROVIDER_ERROR"),
                ModelCallRecord("gpt-x", 0, 1, error="cancelled"),
                ModelCallRecord("gpt-x", 0, 1, error="TimeoutError"),
            ],
        )
    )

    assert value(registry, "lousho_model_calls_total", model="gpt-x", outcome="error") == 2
    assert value(registry, "lousho_model_calls_total", model="gpt-x", outcome="cancelled") == 1
    assert value(registry, "lousho_model_errors_total", model="gpt-x", code="LOUSHO_PROVIDER_ERROR") == 1
    assert value(registry, "lousho_model_errors_total", model="gpt-x", code="TimeoutError") == 1
    assert value(registry, "lousho_model_errors_total", model="gpt-x", code="cancelled") == 0


def test_every_telemetry_event_has_a_family(
    sink: metrics.Metrics, registry: CollectorRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    for event in telemetry.EVENTS:
        sink.count(event, 3, {"agent": "desk", "source": "github", "reason": "LOUSHO_WEBHOOK_SIGNATURE"})

    assert not [r for r in caplog.records if r.name == "lousho.metrics"]
    assert value(registry, "lousho_sweep_resends_total") == 3
    assert value(registry, "lousho_schedule_fires_total") == 3
    assert value(registry, "lousho_schedule_skips_total") == 3
    assert value(registry, "lousho_schedule_misses_total") == 3
    for result in ("accepted", "duplicate", "refused"):
        assert (
            value(
                registry,
                "lousho_webhook_deliveries_total",
                agent="desk",
                source="github",
                result=result,
                reason="LOUSHO_WEBHOOK_SIGNATURE",
            )
            == 3
        )


def test_webhook_labels_the_intake_does_not_give_are_left_empty(
    sink: metrics.Metrics, registry: CollectorRegistry
) -> None:
    sink.count("webhook.accepted", 1, {"agent": "desk"})
    sink.count("webhook.refused", 1, {"reason": "LOUSHO_WEBHOOK_SIGNATURE"})

    assert (
        value(registry, "lousho_webhook_deliveries_total", agent="desk", source="", result="accepted", reason="") == 1
    )
    assert (
        value(
            registry,
            "lousho_webhook_deliveries_total",
            agent="",
            source="",
            result="refused",
            reason="LOUSHO_WEBHOOK_SIGNATURE",
        )
        == 1
    )


def test_an_unknown_event_is_ignored_and_logged_once(
    sink: metrics.Metrics, registry: CollectorRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="lousho.metrics"):
        sink.count("sweep.resnt", 1, {})
        sink.count("sweep.resnt", 1, {})

    assert [r.getMessage() for r in caplog.records] == ["no metric counts the telemetry event 'sweep.resnt'"]
    assert value(registry, "lousho_sweep_resends_total") == 0


def test_the_sink_receives_what_step_code_notes_through_the_telemetry_facade(
    sink: metrics.Metrics, registry: CollectorRegistry
) -> None:
    telemetry.attach(sink)
    try:
        with telemetry.step("run-9", 3) as step:
            telemetry.note(agent="desk", kind=telemetry.TOOL_BATCH, input_started=True)
            telemetry.model_call("mock", 0, input_tokens=7, output_tokens=2)
            telemetry.tool_call("refund", "c1", "ok", 0)
            step.outcome = "advanced"
        telemetry.count("sweep.resent", 2)
    finally:
        telemetry.detach(sink)
    telemetry.count("sweep.resent", 5)  # detached: not counted

    assert value(registry, "lousho_steps_total", agent="desk", kind="tool batch", outcome="advanced") == 1
    assert value(registry, "lousho_runs_started_total", agent="desk") == 1
    assert value(registry, "lousho_model_tokens_total", model="mock", direction="input") == 7
    assert value(registry, "lousho_tool_calls_total", tool="refund", outcome="ok") == 1
    assert value(registry, "lousho_sweep_resends_total") == 2


def test_reconciliations_of_once_calls_are_counted_by_tool_and_outcome(
    sink: metrics.Metrics, registry: CollectorRegistry
) -> None:
    sink.step_done(
        report(
            "advanced",
            kind=telemetry.TOOL_BATCH,
            reconciliations=[("charge", "happened"), ("charge", "asked"), ("email", "happened")],
        )
    )
    sink.step_done(report("failed", kind=telemetry.TOOL_BATCH, reconciliations=[("charge", "failed")]))
    assert value(registry, "lousho_tool_reconciliations_total", tool="charge", outcome="happened") == 1
    assert value(registry, "lousho_tool_reconciliations_total", tool="charge", outcome="asked") == 1
    assert value(registry, "lousho_tool_reconciliations_total", tool="charge", outcome="failed") == 1
    assert value(registry, "lousho_tool_reconciliations_total", tool="email", outcome="happened") == 1


def test_every_documented_family_is_exposed_and_nothing_else() -> None:
    sink = metrics.Metrics()
    sink.step_done(
        report(
            "parked",
            input_started=True,
            ended_as="finished",
            error_code="LOUSHO_X",
            model_calls=[ModelCallRecord("m", 0, 1, 1, 1), ModelCallRecord("m", 0, 1, error="E")],
            tool_calls=[ToolCallRecord("t", "c", "ok", 0, 1)],
        )
    )
    for outcome, ended in (
        ("awaiting-approval", "awaiting-approval"),
        ("aborted", "aborted"),
        ("fenced", None),
        ("busy", None),
    ):
        sink.step_done(report(outcome, ended_as=ended))
    sink.step_done(report("waiting", waited="cool-down", limit_key="acct", cooled=True))
    for event in telemetry.EVENTS:
        sink.count(event, 1, {})

    assert sink.registry is not None
    exposed = {f.name + ("_total" if f.type == "counter" else "") for f in sink.registry.collect()}
    read_at_scrape = {
        "lousho_approvals_waiting",
        "lousho_approval_oldest_age_seconds",
        "lousho_runs_unexplained",
        "lousho_doctor_look_age_seconds",  # by ApprovalsCollector, from Postgres
        "lousho_model_slots_in_use",
        "lousho_model_slots_waiting",
        "lousho_model_limit_cooling_seconds",
    }  # by LimitsCollector, from Redis
    assert exposed | read_at_scrape == set(metrics.FAMILIES)


def test_a_scrape_renders_the_sink_and_leaves_out_approvals_it_cannot_read(
    sink: metrics.Metrics, caplog: pytest.LogCaptureFixture
) -> None:
    sink.count("schedule.fired", 4, {})
    # SQLite refuses Postgres's SET LOCAL: the approvals query fails as it would with Postgres down.
    engine = create_engine("sqlite://")

    body, content_type = metrics.render(sink, engine)
    open_body, open_type = metrics.render(sink, None, "application/openmetrics-text; version=1.0.0")

    assert content_type.startswith("text/plain") and open_type.startswith("application/openmetrics-text")
    assert b"lousho_schedule_fires_total 4.0" in body
    assert b"lousho_approvals_waiting" not in body
    assert b"# EOF" in open_body and b"lousho_schedule_fires_total 4.0" in open_body
    assert "approvals gauges left out of this scrape: StorageError" in caplog.text


def test_the_worker_switch_is_off_without_a_port_and_off_with_an_error_without_the_library(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    attached = list(telemetry._sinks)
    assert metrics.enable_worker(Settings(metrics_port=None)) is False

    monkeypatch.setattr(metrics, "available", lambda: False)
    assert metrics.enable_worker(Settings(metrics_port=9464)) is False
    assert "prometheus-client is not installed" in caplog.text
    assert telemetry._sinks == attached
    assert os.environ.get(metrics.MULTIPROC_ENV) is None


def test_prepare_refuses_a_folder_it_cannot_make(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")

    with pytest.raises(errors.ConfigurationError, match="unusable"):
        metrics.prepare(Settings(metrics_dir=str(blocker / "metrics")))
    assert os.environ.get(metrics.MULTIPROC_ENV) is None


@pytest.fixture
def clean_env() -> Iterator[dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if k != metrics.MULTIPROC_ENV and not k.startswith("LOUSHO_")}
    env["PYTHONPATH"] = str(ROOT)
    yield env


@pytest.mark.parametrize("imported_first", [False, True], ids=["fresh", "imported-before-prepare"])
def test_values_counted_in_forked_pool_processes_add_up_in_the_parents_scrape(
    tmp_path: Path, clean_env: dict[str, str], imported_first: bool
) -> None:
    folder = tmp_path / "metrics"
    folder.mkdir()
    (folder / "counter_999999.db").write_bytes(b"left by an earlier start")
    # The worker's parent: prepare, make the sink, fork two pool processes that count, scrape. The celery
    # command may have imported prometheus_client already (Flower's command plugin does).
    script = textwrap.dedent(f"""
        import os, json
        if {imported_first}:
            import prometheus_client
        from store import metrics, telemetry
        from store.settings import Settings
        folder = metrics.prepare(Settings(metrics_dir={str(folder)!r}))
        sink = metrics.Metrics()
        telemetry.attach(sink)
        children = []
        for n in (1, 2):
            pid = os.fork()
            if pid == 0:
                for _ in range(n):
                    sink.step_done(telemetry.StepReport(
                        session_id="r", agent="a", outcome="finished", ended_as="finished", finish_reason="stop",
                        input_started=True, started_ns=0, ended_ns=10**8))
                telemetry.count("sweep.resent", 10 * n)
                os._exit(0)
            children.append(pid)
        for pid in children:
            os.waitpid(pid, 0)
            metrics.mark_dead(pid)
        body, _ = metrics.render(None, None)
        print(json.dumps({{"body": body.decode(), "files": sorted(p.name for p in folder.iterdir()),
                          "children": children}}))
    """)
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=clean_env, capture_output=True, text=True, timeout=60, check=False
    )

    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    lines = out["body"].splitlines()
    assert 'lousho_runs_started_total{agent="a"} 3.0' in lines
    assert 'lousho_runs_finished_total{agent="a",finish_reason="stop"} 3.0' in lines
    assert 'lousho_step_duration_seconds_count{agent="a",kind="model turn"} 3.0' in lines
    assert "lousho_sweep_resends_total 30.0" in lines
    assert "counter_999999.db" not in out["files"]
    assert {f"counter_{pid}.db" for pid in out["children"]} <= set(out["files"])


def test_the_dashboard_is_valid_json_with_a_panel_for_every_family() -> None:
    dashboard = json.loads(DASHBOARD.read_text())

    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    missing = [family for family in metrics.FAMILIES if not any(family in expr for expr in exprs)]
    assert not missing, f"families with no panel: {missing}"
    unknown = {
        word
        for expr in exprs
        for word in expr.replace("(", " ").replace("{", " ").split()
        if word.startswith("lousho_") and not any(word.startswith(f) for f in metrics.FAMILIES)
    }
    assert not unknown, f"panels query families the code does not expose: {unknown}"
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])


def test_model_limit_waits_are_counted_by_key_and_reason_and_the_gauges_read_the_fleets_slots() -> None:
    sink = metrics.Metrics()
    sink.step_done(report("waiting", waited="slot", limit_key="acct"))
    sink.step_done(report("waiting", waited="cool-down", limit_key="acct", cooled=True))
    assert sink.registry is not None
    assert value(sink.registry, "lousho_model_limit_waits_total", key="acct", reason="slot") == 1
    assert value(sink.registry, "lousho_model_limit_cool_downs_total", key="acct") == 1
    # The gauges come from the slots as Redis holds them (here the in-memory twin)
    slots = MemoryModelSlots(2000)
    limit = ModelLimit("acct", concurrent=1)
    slots.acquire(limit, "r-1", "a")
    slots.acquire(limit, "r-2", "a")
    slots.cool_down("other", 30)
    registry = metrics.exposition(None, None, slots)
    assert value(registry, "lousho_model_slots_in_use", key="acct") == 1
    assert value(registry, "lousho_model_slots_waiting", key="acct") == 1
    assert 29 < value(registry, "lousho_model_limit_cooling_seconds", key="other") <= 30
