"""Spans of real worker processes for the trace crash test: collected in memory, then written to a file per pid.

Workers import this module through ``LOUSHO_AGENTS`` (it defines no agent). With ``LOUSHO_TEST_SPANS`` naming a
folder, importing it makes the process's global ``TracerProvider`` one whose spans the SDK's
``InMemorySpanExporter`` collects; each span, once ended, is moved from it to ``spans-<pid>.jsonl`` in that
folder with one ``os.write`` on an ``O_APPEND`` descriptor (a SIGKILL never leaves half a line). The worker's
parent imports it before it forks its pool, so every pool process has the provider, and ``worker.tracing.enable``
finds it there as the application's provider: the production path, with a test exporter.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

SPANS_ENV = "LOUSHO_TEST_SPANS"
MODULE = __name__


class SpanFiles(SpanExporter):
    """Collects spans in an ``InMemorySpanExporter`` and moves them to this process's file after each export."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.memory = InMemorySpanExporter()
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock:
            result = self.memory.export(spans)
            finished = self.memory.get_finished_spans()
            self.memory.clear()
            if finished:
                data = "".join(json.dumps(_record(span), separators=(",", ":")) + "\n" for span in finished)
                fd = os.open(self.folder / f"spans-{os.getpid()}.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, data.encode())
                finally:
                    os.close(fd)
            return result

    def shutdown(self) -> None:
        self.memory.shutdown()


def _record(span: ReadableSpan) -> dict[str, Any]:
    context = span.context
    assert context is not None
    return {
        "pid": os.getpid(),
        "name": span.name,
        "trace_id": f"{context.trace_id:032x}",
        "span_id": f"{context.span_id:016x}",
        "parent_id": f"{span.parent.span_id:016x}" if span.parent is not None else None,
        "kind": span.kind.name,
        "start": span.start_time,
        "end": span.end_time,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
    }


def install(folder: Path) -> TracerProvider:
    """Make this process's global provider one that writes its spans to ``folder`` (once per process)."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(SpanFiles(folder)))
    trace.set_tracer_provider(provider)
    return provider


def read_spans(folder: Path) -> list[dict[str, Any]]:
    """Every span the processes wrote to ``folder``, in file order."""
    spans: list[dict[str, Any]] = []
    for path in sorted(folder.glob("spans-*.jsonl")):
        spans.extend(json.loads(line) for line in path.read_text().splitlines() if line)
    return spans


if os.environ.get(SPANS_ENV):
    install(Path(os.environ[SPANS_ENV]))
