"""OpenTelemetry traces of runs: one trace per run input across its steps, made from each step's report.

Owns the trace context saved with a run input and the spans made from ``store.telemetry`` reports; it never
runs inside a step's work and never records a prompt, a tool argument or an output. Needs the ``otel`` extra.

Spans follow the OpenTelemetry GenAI semantic conventions (status Development; the latest names, with
``gen_ai.provider.name`` rather than the older ``gen_ai.system``), kept since semantic-conventions 1.41 in
https://github.com/open-telemetry/semantic-conventions-genai: ``docs/gen-ai/gen-ai-agent-spans.md`` (the
``invoke_agent`` span, INTERNAL for an agent run in-process) and ``docs/gen-ai/gen-ai-spans.md`` (``chat``
inference spans, CLIENT, and ``execute_tool`` spans, INTERNAL).

A run input's trace::

    invoke_agent <agent>        INTERNAL  the run input: from the step that merged it to the one that ended it
    ├── step <kind>             INTERNAL  one Celery task (lousho.advance), on whichever worker process ran it
    │   ├── chat <model>        CLIENT    a model call, with its token counts
    │   └── execute_tool <tool> INTERNAL  a tool call, with its outcome
    └── step <kind> ...

A step's process cannot keep a span open for the next step's process, so every span is made after the fact,
with the start and end times the report recorded. The step that merges an input makes its trace context (a W3C
``traceparent`` plus the step's start time, ``00-<trace id>-<root span id>-01;t=<ns>``), which the run's
checkpoint keeps; each later step of the input is a child of that root span id. The root span itself is made
by the step whose save ends the input (``ROOT_ENDINGS``), with the ids saved in the context and the start time
written there, so it covers the whole input, waits for a person included. It is made once: a save that ends
the input is fenced (at most one step makes it), and an input stopped by an abort or its budget that is then
resumed must go on in a new trace (the step that resumes it makes one, as for new input). Until the end, and for
an input paused and never resumed, the steps wait under a root that has not arrived (backends show them under a
missing parent). A step killed with its process takes its spans with it.

Attributes: ``gen_ai.operation.name``, ``gen_ai.agent.name``, ``gen_ai.conversation.id`` (the run's session
id), ``gen_ai.request.model`` and ``gen_ai.provider.name`` (from a ``provider:model`` model id; a model id
without a provider, such as ``MockModel``'s, gives no provider), ``gen_ai.usage.input_tokens`` and
``gen_ai.usage.output_tokens``, ``gen_ai.response.finish_reasons``, ``gen_ai.tool.name``,
``gen_ai.tool.call.id``, ``gen_ai.tool.type``; ``error.type`` (a provider error code, an exception's class
name, a tool result's error kind, a run's error code) with status ERROR; ``messaging.message.id`` (the Celery
task id); and ``lousho.session_id``, ``lousho.seq``, ``lousho.kind``, ``lousho.outcome``, ``lousho.ended_as``,
``lousho.finish_reason``, ``lousho.tool.outcome``.

Stays whole: the span tree of a run and the one place that sets up OpenTelemetry, read together.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from store import telemetry
from store.settings import Settings

try:
    from opentelemetry import trace as trace_api
    from opentelemetry.context import Context
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import Tracer, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
    from opentelemetry.sdk.trace.id_generator import IdGenerator
    from opentelemetry.sdk.trace.sampling import Decision
except ImportError:  # the ``otel`` extra is not installed: ``enable`` says so and nothing is traced
    HAVE_OTEL = False
else:
    HAVE_OTEL = True

log = logging.getLogger("lousho.tracing")

#: How a run input ends for its trace: the step whose save ends it this way makes the root span. A pause waits
#: for a person and the input goes on in the same trace afterwards, so it is not an end here.
ROOT_ENDINGS = ("finished", "aborted", "budget-exceeded")
#: Step outcomes that did no work for the input (a duplicate, a message for a run another worker holds).
_NO_WORK = telemetry.NO_WORK
#: Step outcomes that are errors (``None``: the step raised before it had one).
_ERRORS = ("failed", "parked", "misconfigured", None)
#: Run input endings that are errors.
_ERROR_ENDINGS = ("budget-exceeded",)
#: ``service.name`` when the environment names no service.
SERVICE_NAME = "lousho-worker"
#: The OTLP exporter class of each ``OTEL_EXPORTER_OTLP_PROTOCOL`` (packages ``opentelemetry-exporter-otlp-*``).
_OTLP_MODULES = {
    "http/protobuf": "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "grpc": "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
}
_CONTEXT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})((?:;[a-z]+=[0-9A-Za-z_.-]*)*)")
_CONTEXT_MAX = 512


@dataclass(frozen=True)
class TraceContext:
    """The trace context of a run input, as its checkpoint keeps it (``Checkpoint.trace``)."""

    trace_id: int
    #: The run input's root span (``invoke_agent``): the parent of each of its steps.
    span_id: int
    sampled: bool = True
    #: When the input's first step started (``time.time_ns``): the root span's start.
    started_ns: int | None = None

    def dump(self) -> str:
        """The saved form: a W3C ``traceparent``, then ``;t=<started_ns>`` when known."""
        text = f"00-{self.trace_id:032x}-{self.span_id:016x}-{1 if self.sampled else 0:02x}"
        return text if self.started_ns is None else f"{text};t={self.started_ns}"

    @classmethod
    def parse(cls, text: str | None) -> TraceContext | None:
        """The context saved as ``text``; None for none or a malformed one (fields it does not know are skipped)."""
        if not text or len(text) > _CONTEXT_MAX:
            return None
        found = _CONTEXT.fullmatch(text)
        if found is None:
            return None
        trace_id, span_id = int(found.group(1), 16), int(found.group(2), 16)
        if not trace_id or not span_id:
            return None
        fields = dict(item.partition("=")[::2] for item in found.group(4).split(";") if item)
        started = fields.get("t", "")
        return cls(trace_id, span_id, bool(int(found.group(3), 16) & 1), int(started) if started.isdigit() else None)


class _SavedIds:
    """The provider's id generator, except for a root span made now with the ids its run input saved.

    The SDK asks its id generator for a root span's trace id and then its span id; ``due`` sets both for the
    next root span this thread makes (the sink's own thread: spans are made one after another there).
    """

    def __init__(self, inner: IdGenerator) -> None:
        self.inner = inner
        self._due = threading.local()

    def due(self, trace_id: int, span_id: int) -> None:
        """The next root span made in this thread gets these ids."""
        self._due.ids = (trace_id, span_id)

    def clear(self) -> None:
        """Forget ids that were not used."""
        self._due.ids = None

    def generate_trace_id(self) -> int:
        """The saved trace id when a root span is due, else a new one."""
        ids: tuple[int, int] | None = getattr(self._due, "ids", None)
        return ids[0] if ids is not None else self.inner.generate_trace_id()

    def generate_span_id(self) -> int:
        """The saved span id when a root span is due (then no longer due), else a new one."""
        ids: tuple[int, int] | None = getattr(self._due, "ids", None)
        if ids is None:
            return self.inner.generate_span_id()
        self._due.ids = None
        return ids[1]

    def is_trace_id_random(self) -> bool:
        """What the provider's generator says (the saved trace ids are its own)."""
        return bool(self.inner.is_trace_id_random())


class TraceSink:
    """A ``telemetry.Sink`` that turns each step's report into spans, and makes run inputs' trace contexts."""

    def __init__(self, provider: TracerProvider) -> None:
        current = provider.id_generator
        # A provider set up elsewhere (an application's, a test's) gets the root ids too: ``_SavedIds``
        # passes everything else through to its generator.
        self._ids = current if isinstance(current, _SavedIds) else _SavedIds(current)
        # Duck-typed (the SDK only calls its methods); the SDK annotates the attribute as its default class.
        cast(Any, provider).id_generator = self._ids
        self.provider = provider
        self._tracer = provider.get_tracer("lousho.worker")
        if isinstance(self._tracer, Tracer):  # one the provider made before (it keeps its tracers)
            self._tracer.id_generator = cast(IdGenerator, self._ids)

    def new_context(self) -> str | None:
        """A new run input's trace context (``telemetry.use_traces``); None when the sampler drops the trace."""
        trace_id, span_id = self._ids.inner.generate_trace_id(), self._ids.inner.generate_span_id()
        sampling = self.provider.sampler.should_sample(Context(), trace_id, "invoke_agent", trace_api.SpanKind.INTERNAL)
        if sampling.decision is not Decision.RECORD_AND_SAMPLE:
            return None
        report = telemetry.current()
        started = report.started_ns if report is not None and report.started_ns else time.time_ns()
        return TraceContext(trace_id, span_id, True, started).dump()

    def step_done(self, report: telemetry.StepReport) -> None:
        """Make the step's span and its calls' spans, and the input's root span when the step ended the input."""
        context = TraceContext.parse(report.trace)
        if context is None or not context.sampled or report.outcome in _NO_WORK:
            return
        root = trace_api.NonRecordingSpan(
            trace_api.SpanContext(
                context.trace_id, context.span_id, is_remote=True, trace_flags=trace_api.TraceFlags(1)
            )
        )
        ended = report.ended_ns or time.time_ns()
        step = self._tracer.start_span(
            f"step {report.kind}",
            trace_api.set_span_in_context(root, Context()),
            attributes=_step_attributes(report),
            start_time=report.started_ns or ended,
        )
        if report.outcome in _ERRORS:
            step.set_attribute("error.type", report.error_code or "_OTHER")
            step.set_status(trace_api.StatusCode.ERROR, report.error_code or "the step raised")
        inside = trace_api.set_span_in_context(step, Context())
        for model_call in report.model_calls:
            self._chat(model_call, inside)
        for tool_call in report.tool_calls:
            self._tool(tool_call, inside)
        step.end(end_time=ended)
        if report.ended_as in ROOT_ENDINGS:
            self._root(report, context, ended)

    def count(self, event: str, amount: int, labels: dict[str, str]) -> None:
        """Counts are metrics, not spans."""

    def _chat(self, call: telemetry.ModelCallRecord, parent: Context) -> None:
        provider, model = _model_parts(call.model)
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": provider,
            "gen_ai.request.model": model,
            "gen_ai.usage.input_tokens": call.input_tokens,
            "gen_ai.usage.output_tokens": call.output_tokens,
            "gen_ai.response.finish_reasons": [call.finish_reason] if call.finish_reason else None,
            "error.type": call.error,
        }
        span = self._tracer.start_span(
            f"chat {model}",
            parent,
            kind=trace_api.SpanKind.CLIENT,
            attributes=_present(attributes),
            start_time=call.started_ns,
        )
        if call.error is not None:
            span.set_status(trace_api.StatusCode.ERROR, call.error)
        span.end(end_time=call.ended_ns)

    def _tool(self, call: telemetry.ToolCallRecord, parent: Context) -> None:
        failed = call.outcome != "ok"
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": call.tool,
            "gen_ai.tool.call.id": call.call_id,
            "gen_ai.tool.type": "function",
            "lousho.tool.outcome": call.outcome,
            "error.type": call.outcome if failed else None,
        }
        span = self._tracer.start_span(
            f"execute_tool {call.tool}", parent, attributes=_present(attributes), start_time=call.started_ns
        )
        if failed:
            span.set_status(trace_api.StatusCode.ERROR, call.outcome)
        span.end(end_time=call.ended_ns)

    def _root(self, report: telemetry.StepReport, context: TraceContext, ended: int) -> None:
        agent = report.agent or "agent"
        failed = report.ended_as in _ERROR_ENDINGS
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.agent.name": report.agent,
            "gen_ai.conversation.id": report.session_id,
            "lousho.session_id": report.session_id,
            "lousho.ended_as": report.ended_as,
            "lousho.finish_reason": report.finish_reason,
            "error.type": report.ended_as if failed else None,
        }
        self._ids.due(context.trace_id, context.span_id)
        try:
            # An empty context: the root has no parent, whatever span this thread has current.
            span = self._tracer.start_span(
                f"invoke_agent {agent}",
                Context(),
                attributes=_present(attributes),
                start_time=min(context.started_ns or report.started_ns, ended),
            )
        finally:
            self._ids.clear()
        if failed:
            span.set_status(trace_api.StatusCode.ERROR, report.ended_as)
        span.end(end_time=ended)


def _step_attributes(report: telemetry.StepReport) -> dict[str, Any]:
    return _present(
        {
            "gen_ai.agent.name": report.agent,
            "gen_ai.conversation.id": report.session_id,
            "lousho.session_id": report.session_id,
            "lousho.seq": report.seq,
            "lousho.kind": report.kind,
            "lousho.outcome": report.outcome or "raised",
            "messaging.message.id": report.task_id,
            "lousho.input_started": report.input_started or None,
            "lousho.ended_as": report.ended_as,
            "lousho.approvals": report.approvals or None,
            "lousho.retry_in_s": report.retry_in,
        }
    )


def _present(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """The attributes that have a value (OpenTelemetry refuses None)."""
    return {key: value for key, value in attributes.items() if value is not None}


def _model_parts(model_id: str) -> tuple[str | None, str]:
    """(provider, model) of a model id: ``openai:gpt-4o`` -> (``openai``, ``gpt-4o``); ``mock`` -> (None, ``mock``)."""
    provider, colon, model = model_id.partition(":")
    return (provider, model) if colon and provider and model else (None, model_id)


_state: dict[str, Any] = {"pid": None, "sink": None}
_lock = threading.Lock()


def enable(settings: Settings, provider: TracerProvider | None = None) -> bool:
    """Trace this process's steps when ``settings.tracing`` is on: attach the sink and make inputs' contexts.

    Call it in each process that runs steps, after any fork (a prefork pool process); a second call in the
    same process does nothing. Spans go to ``provider`` when given (a test's), else to the process's global
    SDK ``TracerProvider`` when the application set one up (``opentelemetry-instrument``, its own code), else
    to one built here from the standard environment and made the global one: ``OTEL_TRACES_EXPORTER``
    (``otlp``, the default, needs ``opentelemetry-exporter-otlp-proto-http``, or ``-grpc`` with
    ``OTEL_EXPORTER_OTLP_PROTOCOL=grpc``, and reads ``OTEL_EXPORTER_OTLP_ENDPOINT``, default localhost:4318;
    ``console`` prints spans; ``none`` makes them and drops them), ``OTEL_SERVICE_NAME`` (default
    ``lousho-worker``), ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER`` and ``OTEL_BSP_*``.

    Returns:
        Whether this process's steps are traced (False, with a log line saying why, when the ``otel`` extra or
        the configured exporter is missing, or ``OTEL_SDK_DISABLED`` is set).
    """
    if not settings.tracing:
        return False
    if not HAVE_OTEL:
        log.error(
            "LOUSHO_TRACING is on but OpenTelemetry is not installed (pip install 'lousho-worker[otel]');"
            " runs are not traced"
        )
        return False
    with _lock:
        sink: TraceSink | None = _state["sink"]
        if sink is not None and _state["pid"] == os.getpid() and provider in (None, sink.provider):
            return True
        _detach()  # a sink inherited through a fork, or one with another provider
        try:
            chosen = provider if provider is not None else _configured_provider()
            sink = TraceSink(chosen) if chosen is not None else None
        except Exception:  # a broken OTEL_* setting must not stop the worker: it runs untraced, and says so
            log.error("LOUSHO_TRACING is on but OpenTelemetry could not be set up; runs are not traced", exc_info=True)
            return False
        if sink is None:
            return False
        telemetry.attach(sink)
        telemetry.use_traces(sink.new_context)
        _state.update(pid=os.getpid(), sink=sink)
    log.info("tracing on: each run input is a trace, its steps are spans")
    return True


def disable() -> None:
    """Stop tracing this process's steps (spans already made are still exported)."""
    with _lock:
        _detach()


def flush(timeout_s: float = 5.0) -> bool:
    """Export the spans made so far; call before a process exits without running ``atexit`` (a pool process).

    Returns:
        False when spans may still be waiting (no tracing in this process returns True).
    """
    sink: TraceSink | None = _state["sink"]
    if sink is None or _state["pid"] != os.getpid():
        return True
    return bool(sink.provider.force_flush(int(timeout_s * 1000)))


def _detach() -> None:
    sink: TraceSink | None = _state["sink"]
    if sink is not None:
        telemetry.detach(sink)
        telemetry.use_traces(None)
    _state.update(pid=None, sink=None)


def _configured_provider() -> TracerProvider | None:
    """The application's global SDK provider, or one built from the ``OTEL_*`` environment (made global)."""
    current = trace_api.get_tracer_provider()
    if isinstance(current, TracerProvider):
        return current
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        log.warning("LOUSHO_TRACING is on but OTEL_SDK_DISABLED=true; runs are not traced")
        return None
    exporters = _exporters()
    if exporters is None:
        return None
    named = os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    built = TracerProvider(resource=Resource.create({} if named else {"service.name": SERVICE_NAME}))
    for exporter in exporters:
        built.add_span_processor(BatchSpanProcessor(exporter))
    if isinstance(current, trace_api.ProxyTracerProvider):  # none set yet: other instrumentations share ours
        trace_api.set_tracer_provider(built)
    return built


def _exporters() -> list[SpanExporter] | None:
    """The exporters ``OTEL_TRACES_EXPORTER`` names; None (logged) when one cannot be made."""
    names = [n.strip() for n in os.environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",") if n.strip()]
    made: list[SpanExporter] = []
    for name in names:
        if name == "none":
            continue
        if name == "console":
            made.append(ConsoleSpanExporter())
            continue
        if name != "otlp":
            log.error(
                "LOUSHO_TRACING is on but OTEL_TRACES_EXPORTER names %r (otlp, console or none here);"
                " runs are not traced",
                name,
            )
            return None
        protocol = (
            os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            or "http/protobuf"
        )
        module = _OTLP_MODULES.get(protocol)
        if module is None:
            log.error(
                "LOUSHO_TRACING is on but the OTLP protocol %r is not one of %s; runs are not traced",
                protocol,
                ", ".join(_OTLP_MODULES),
            )
            return None
        try:
            made.append(importlib.import_module(module).OTLPSpanExporter())
        except ImportError:
            package = "opentelemetry-exporter-otlp-proto-" + ("grpc" if protocol == "grpc" else "http")
            log.error(
                "LOUSHO_TRACING is on and OTEL_TRACES_EXPORTER is otlp (the default), but %s is not"
                " installed: install it, or set OTEL_TRACES_EXPORTER=console; runs are not traced",
                package,
            )
            return None
    return made


__all__ = ["HAVE_OTEL", "ROOT_ENDINGS", "SERVICE_NAME", "TraceContext", "TraceSink", "disable", "enable", "flush"]
