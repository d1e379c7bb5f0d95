"""Traces from step reports: one trace per run input, its root made by the step that ended it (``worker.tracing``).

Spans are collected with the SDK's ``InMemorySpanExporter`` behind a ``SimpleSpanProcessor``; the steps are
fed through ``store.telemetry.step`` the way ``lousho.advance`` runs them, the trace context passed between
"processes" only as the string a checkpoint keeps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import SpanKind, StatusCode

from store import telemetry
from store.settings import Settings
from worker import tracing
from worker.steps import Outcome
from worker.tracing import TraceContext

ON = Settings(tracing=True)
#: Every attribute a span may carry: names, ids, counts and codes, never content.
ALLOWED = {
    "gen_ai.operation.name",
    "gen_ai.agent.name",
    "gen_ai.conversation.id",
    "gen_ai.provider.name",
    "gen_ai.request.model",
    "gen_ai.usage.input_tokens",
    "gen_ai.usage.output_tokens",
    "gen_ai.response.finish_reasons",
    "gen_ai.tool.name",
    "gen_ai.tool.call.id",
    "gen_ai.tool.type",
    "error.type",
    "messaging.message.id",
    "lousho.session_id",
    "lousho.seq",
    "lousho.kind",
    "lousho.outcome",
    "lousho.input_started",
    "lousho.ended_as",
    "lousho.approvals",
    "lousho.retry_in_s",
    "lousho.finish_reason",
    "lousho.tool.outcome",
}


@dataclass
class Process:
    """What one worker process has: its own provider and in-memory exporter."""

    provider: TracerProvider
    exporter: InMemorySpanExporter

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())


def _process(**provider_options: object) -> Process:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(**provider_options)  # type: ignore[arg-type]  # sampler only, in these tests
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Process(provider, exporter)


@pytest.fixture
def process() -> Iterator[Process]:
    made = _process()
    assert tracing.enable(ON, provider=made.provider)
    yield made
    tracing.disable()


def _merge_step(session_id: str = "run-1", agent: str = "support") -> str:
    """A model turn that merges a new input: it makes the input's trace context, as the step's save does."""
    with telemetry.step(session_id, 1, task_id="task-1"):
        telemetry.note(agent=agent, kind=telemetry.MODEL_TURN)
        started = time.time_ns()
        telemetry.model_call("openai:gpt-4o", started, input_tokens=120, output_tokens=30, finish_reason="tool_calls")
        trace = telemetry.new_trace()
        telemetry.note(input_started=True, trace=trace, calls_asked=2, outcome="advanced")
    assert trace is not None
    return trace


def _tool_step(trace: str, session_id: str = "run-1", agent: str = "support") -> None:
    with telemetry.step(session_id, 2, task_id="task-2") as report:
        telemetry.note(agent=agent, kind=telemetry.TOOL_BATCH, trace=trace)
        started = time.time_ns()
        telemetry.tool_call("lookup", "call-a", "ok", started)
        telemetry.tool_call("charge", "call-b", "timeout", started)
        report.outcome = "advanced"


def _final_step(trace: str, ended_as: str = "finished", session_id: str = "run-1", agent: str = "support") -> None:
    with telemetry.step(session_id, 3, task_id="task-3"):
        telemetry.note(agent=agent, kind=telemetry.MODEL_TURN, trace=trace)
        telemetry.model_call("openai:gpt-4o", time.time_ns(), input_tokens=200, output_tokens=12, finish_reason="stop")
        telemetry.note(ended_as=ended_as, finish_reason="stop", outcome="finished")


def _named(spans: list[ReadableSpan], prefix: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name.startswith(prefix)]


def _span_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return int(span.context.span_id)


def _parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def test_a_run_input_is_one_trace_with_its_steps_under_the_root_and_calls_under_the_steps(process: Process) -> None:
    trace = _merge_step()
    _tool_step(trace)
    _final_step(trace)

    spans = process.spans()
    context = TraceContext.parse(trace)
    assert context is not None
    assert {s.context.trace_id for s in spans if s.context is not None} == {context.trace_id}
    [root] = _named(spans, "invoke_agent ")
    steps = _named(spans, "step ")
    assert root.name == "invoke_agent support" and root.parent is None and _span_id(root) == context.span_id
    assert root.kind is SpanKind.INTERNAL
    assert [s.name for s in steps] == ["step model turn", "step tool batch", "step model turn"]
    assert all(_parent_id(s) == context.span_id for s in steps)
    # The root covers the input: from the start of the step that merged it to the end of the one that ended it.
    assert root.start_time == steps[0].start_time and root.end_time == steps[-1].end_time
    assert root.attributes is not None and root.attributes["gen_ai.operation.name"] == "invoke_agent"
    assert root.attributes["lousho.ended_as"] == "finished" and root.attributes["gen_ai.conversation.id"] == "run-1"
    step_ids = {_span_id(s) for s in steps}
    calls = _named(spans, "chat ") + _named(spans, "execute_tool ")
    assert len(calls) == 4 and all(_parent_id(c) in step_ids for c in calls)
    assert len(spans) == 1 + 3 + 4


def test_model_calls_carry_the_model_and_token_counts(process: Process) -> None:
    trace = _merge_step()
    _final_step(trace)

    first, last = _named(process.spans(), "chat ")
    assert first.name == "chat gpt-4o" and first.kind is SpanKind.CLIENT
    assert dict(first.attributes or {}) == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": "gpt-4o",
        "gen_ai.usage.input_tokens": 120,
        "gen_ai.usage.output_tokens": 30,
        "gen_ai.response.finish_reasons": ("tool_calls",),
    }
    assert last.attributes is not None and last.attributes["gen_ai.usage.input_tokens"] == 200
    assert first.end_time is not None and first.start_time is not None and first.end_time >= first.start_time


def test_tool_calls_carry_the_tool_and_call_id_and_a_failed_one_is_an_error(process: Process) -> None:
    _tool_step(_merge_step())

    ok, timed_out = _named(process.spans(), "execute_tool ")
    assert ok.name == "execute_tool lookup" and ok.kind is SpanKind.INTERNAL
    assert dict(ok.attributes or {}) == {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": "lookup",
        "gen_ai.tool.call.id": "call-a",
        "gen_ai.tool.type": "function",
        "lousho.tool.outcome": "ok",
    }
    assert ok.status.status_code is StatusCode.UNSET
    assert timed_out.attributes is not None and timed_out.attributes["error.type"] == "timeout"
    assert timed_out.status.status_code is StatusCode.ERROR


def test_step_spans_name_the_run_seq_kind_outcome_and_celery_task(process: Process) -> None:
    _merge_step()

    [step] = _named(process.spans(), "step ")
    assert dict(step.attributes or {}) == {
        "gen_ai.agent.name": "support",
        "gen_ai.conversation.id": "run-1",
        "lousho.session_id": "run-1",
        "lousho.seq": 1,
        "lousho.kind": "model turn",
        "lousho.outcome": "advanced",
        "messaging.message.id": "task-1",
        "lousho.input_started": True,
    }


def test_steps_in_another_process_join_the_trace_from_the_saved_context_alone() -> None:
    first, second = _process(), _process()
    # A tracer the second provider made before: the root still takes the saved ids.
    second.provider.get_tracer("lousho.worker")
    try:
        assert tracing.enable(ON, provider=first.provider)
        trace = _merge_step()
        assert tracing.enable(ON, provider=second.provider)
        _tool_step(trace)
        _final_step(trace)
    finally:
        tracing.disable()

    context = TraceContext.parse(trace)
    assert context is not None
    [merged] = _named(first.spans(), "step ")
    later = _named(second.spans(), "step ")
    [root] = _named(second.spans(), "invoke_agent ")
    assert len(later) == 2 and not _named(first.spans(), "invoke_agent ")
    everything = first.spans() + second.spans()
    assert {s.context.trace_id for s in everything if s.context is not None} == {context.trace_id}
    assert _span_id(root) == context.span_id and root.start_time == merged.start_time
    assert all(_parent_id(s) == _span_id(root) for s in [merged, *later])


def test_a_pause_is_not_the_end_of_the_input_so_no_root_until_it_finishes(process: Process) -> None:
    trace = _merge_step()
    _final_step(trace, ended_as="awaiting-approval")
    assert not _named(process.spans(), "invoke_agent ")

    _final_step(trace, ended_as="finished")

    [root] = _named(process.spans(), "invoke_agent ")
    assert root.start_time == _named(process.spans(), "step ")[0].start_time


def test_an_input_stopped_by_its_budget_ends_its_trace_with_an_error(process: Process) -> None:
    _final_step(_merge_step(), ended_as="budget-exceeded")

    [root] = _named(process.spans(), "invoke_agent ")
    assert root.status.status_code is StatusCode.ERROR
    assert root.attributes is not None and root.attributes["error.type"] == "budget-exceeded"


@pytest.mark.parametrize("outcome", ["parked", "failed"])
def test_a_parked_or_failed_step_is_an_error_with_its_code(process: Process, outcome: str) -> None:
    trace = _merge_step()
    with telemetry.step("run-1", 2, task_id="task-2") as report:
        telemetry.note(agent="support", trace=trace, error_code="LOUSHO_PROVIDER_ERROR", outcome=outcome)
        telemetry.model_call("anthropic:claude-x", time.time_ns(), error="LOUSHO_PROVIDER_ERROR")

    step = _named(process.spans(), "step ")[-1]
    assert report.outcome == outcome
    assert step.status.status_code is StatusCode.ERROR
    assert step.attributes is not None and step.attributes["error.type"] == "LOUSHO_PROVIDER_ERROR"
    chat = _named(process.spans(), "chat claude-x")[0]
    assert chat.status.status_code is StatusCode.ERROR and chat.attributes is not None
    assert chat.attributes["error.type"] == "LOUSHO_PROVIDER_ERROR" and "gen_ai.usage.input_tokens" in chat.attributes


def test_a_step_that_raised_before_its_outcome_is_an_error(process: Process) -> None:
    trace = _merge_step()
    with pytest.raises(RuntimeError), telemetry.step("run-1", 2) as report:
        report.trace = trace
        raise RuntimeError("boom")

    step = _named(process.spans(), "step ")[-1]
    assert step.status.status_code is StatusCode.ERROR and step.attributes is not None
    assert step.attributes["lousho.outcome"] == "raised" and step.attributes["error.type"] == "_OTHER"


#: Step outcomes that did no work for the input, named here (not read from the list under test).
NO_WORK = [Outcome.BUSY, Outcome.STALE, Outcome.UNKNOWN, Outcome.IDLE, Outcome.HANDED_BACK]


@pytest.mark.parametrize("outcome", NO_WORK)
def test_steps_that_did_no_work_make_no_span(process: Process, outcome: str) -> None:
    trace = _merge_step()
    process.exporter.clear()
    with telemetry.step("run-1", 2) as report:
        report.trace, report.outcome = trace, outcome

    assert process.spans() == []


@pytest.mark.parametrize(
    "saved", [None, "", "garbage", "00-" + "0" * 32 + "-" + "1" * 16 + "-01", "00-" + "a" * 32 + "-" + "b" * 16 + "-00"]
)
def test_steps_without_a_usable_or_sampled_context_make_no_span(process: Process, saved: str | None) -> None:
    with telemetry.step("run-1", 2) as report:
        report.trace, report.outcome = saved, "advanced"

    assert process.spans() == []


def test_the_saved_context_is_a_traceparent_with_the_input_start_and_reads_back() -> None:
    context = TraceContext(0xABC, 0x123, True, 1_700_000_000_000_000_000)

    text = context.dump()

    assert text == f"00-{0xABC:032x}-{0x123:016x}-01;t=1700000000000000000"
    assert len(text) <= 512
    assert TraceContext.parse(text) == context
    assert TraceContext.parse(text + ";x=later-field") == context
    assert TraceContext.parse(f"00-{0xABC:032x}-{0x123:016x}-01") == TraceContext(0xABC, 0x123, True, None)
    assert TraceContext.parse(text.upper()) is None
    assert TraceContext.parse(f"00-{0xABC:032x}-{0x123:016x}-01;t=soon") == TraceContext(0xABC, 0x123, True, None)
    assert TraceContext.parse(text + ";t") is None


def test_a_new_input_gets_a_fresh_trace_each_time(process: Process) -> None:
    contexts = [TraceContext.parse(telemetry.new_trace()) for _ in range(3)]

    assert all(c is not None for c in contexts)
    assert len({c.trace_id for c in contexts if c is not None}) == 3


def test_a_sampler_that_drops_the_trace_makes_no_context() -> None:
    dropped = _process(sampler=ALWAYS_OFF)
    try:
        assert tracing.enable(ON, provider=dropped.provider)
        assert telemetry.new_trace() is None
    finally:
        tracing.disable()


def test_no_attribute_carries_content(process: Process) -> None:
    trace = _merge_step()
    _tool_step(trace)
    _final_step(trace)

    for span in process.spans():
        assert set(span.attributes or {}) <= ALLOWED, span.name


def test_enable_is_idempotent_in_a_process_and_disable_stops_the_spans(process: Process) -> None:
    assert tracing.enable(ON)
    _merge_step()
    assert len(_named(process.spans(), "step ")) == 1

    tracing.disable()
    with telemetry.step("run-1", 1) as report:
        report.trace, report.outcome = "00-" + "a" * 32 + "-" + "b" * 16 + "-01", "advanced"

    assert telemetry.new_trace() is None
    assert len(_named(process.spans(), "step ")) == 1


def test_tracing_is_off_unless_the_setting_says_so() -> None:
    assert not tracing.enable(Settings(tracing=False), provider=_process().provider)
    assert telemetry.new_trace() is None


def test_without_the_extra_enable_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(tracing, "HAVE_OTEL", False)

    with caplog.at_level(logging.ERROR, logger="lousho.tracing"):
        assert not tracing.enable(ON)

    assert "pip install 'lousho-worker[otel]'" in caplog.text
    assert telemetry.new_trace() is None


def test_the_exporter_comes_from_the_standard_environment(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    [console] = tracing._exporters() or []
    assert isinstance(console, ConsoleSpanExporter)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert tracing._exporters() == []
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with caplog.at_level(logging.ERROR, logger="lousho.tracing"):
        assert tracing._exporters() is None
    assert "'zipkin'" in caplog.text


def test_the_otlp_default_without_its_package_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("opentelemetry.sdk")
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("the OTLP HTTP exporter is installed here")
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)

    with caplog.at_level(logging.ERROR, logger="lousho.tracing"):
        assert tracing._exporters() is None

    assert "opentelemetry-exporter-otlp-proto-http" in caplog.text and "OTEL_TRACES_EXPORTER=console" in caplog.text


def test_the_applications_own_sdk_provider_is_used_when_none_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    application = _process()
    monkeypatch.setattr("opentelemetry.trace.get_tracer_provider", lambda: application.provider)
    try:
        assert tracing.enable(ON)
        _final_step(_merge_step())
    finally:
        tracing.disable()

    assert [s.name for s in application.spans() if s.parent is None] == ["invoke_agent support"]


def test_a_setup_that_fails_leaves_the_worker_untraced_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken() -> None:
        raise ValueError("OTEL_TRACES_SAMPLER_ARG is not a number")

    monkeypatch.setattr(tracing, "_configured_provider", broken)

    with caplog.at_level(logging.ERROR, logger="lousho.tracing"):
        assert not tracing.enable(ON)

    assert "could not be set up" in caplog.text
    assert telemetry.new_trace() is None
