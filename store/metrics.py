"""Prometheus metrics of runs, steps, sweeps, schedules and webhook intake: a ``telemetry.Sink`` on prometheus-client.

Owns the families below and their exposition (the worker's port, the HTTP server's ``/metrics``). It must not
import prometheus-client when imported itself: ``prepare`` chooses the multiprocess mode a prefork worker needs
before the library's value class is picked. Labels are names from code and codes, never content.

Families (counters are exposed with ``_total``; histograms as ``_bucket``, ``_sum`` and ``_count``):

- ``lousho_runs_started_total{agent}``: run inputs a step started (merged from the inbox).
- ``lousho_runs_finished_total{agent,finish_reason}``: inputs that ended finished (``budget-exceeded`` included).
- ``lousho_runs_awaiting_approval_total{agent}``: inputs that stopped to wait for a person's decisions (named
  ``lousho_runs_paused_total`` before the runs' states were one vocabulary).
- ``lousho_runs_parked_total{agent,code}``: steps that parked their run on a non-retryable ``LOUSHO_*`` error.
- ``lousho_runs_aborted_total{agent}``: inputs that ended on an abort request.
- ``lousho_steps_total{agent,kind,outcome}``: every ``lousho.advance``; ``outcome`` is ``worker.context.Outcome``
  (``error`` when the step raised); ``agent`` is ``unknown`` for a step dropped before its run was loaded.
- ``lousho_step_duration_seconds{agent,kind}``: steps that did work (drops and idle steps are not timed).
- ``lousho_model_calls_total{model,outcome}``: ``ok``, ``error`` or ``cancelled``.
- ``lousho_model_tokens_total{model,direction}``: ``input`` or ``output`` tokens the calls reported.
- ``lousho_model_errors_total{model,code}``: failed calls by error code (or exception class).
- ``lousho_tool_calls_total{tool,outcome}`` and ``lousho_tool_duration_seconds{tool,outcome}``: ``ok`` or the
  error kind of the call's result.
- ``lousho_tool_reconciliations_total{tool,outcome}``: ``once`` calls found started without a result, by what
  became of them: ``happened``, ``not-happened`` (run again), ``not-done``, ``failed`` (``reconcile`` raised) or
  ``asked`` (a person decides).
- ``lousho_fenced_saves_total{agent}``: saves refused because another holder took the run over.
- ``lousho_busy_drops_total``: steps dropped because another process held the run's lease.
- ``lousho_sweep_resends_total``: steps the recovery sweep sent.
- ``lousho_schedule_fires_total``, ``lousho_schedule_skips_total``, ``lousho_schedule_misses_total``: ticks fired,
  claimed without a run (overlap) and dropped as overdue.
- ``lousho_webhook_deliveries_total{agent,source,result,reason}``: ``accepted`` or ``duplicate`` (by agent and
  source: ``standard-webhooks`` or ``github``), or ``refused`` (by ``reason`` only: a refused path names whatever
  the sender wrote, and a refused delivery's source is not known for sure); a label not given is empty.
- ``lousho_approvals_waiting`` and ``lousho_approval_oldest_age_seconds``: undecided, unexpired approvals and the
  age of the oldest, read from Postgres at scrape time (no per-process state).
- ``lousho_runs_unexplained`` and ``lousho_doctor_look_age_seconds``: unfinished runs with no owner, timer or
  waiter past the grace (invariant I19; 0 when all is well) at the latest look of the checker (``store.doctor``),
  and how long ago that look was; read from Postgres at scrape time, absent until a first look.
- ``lousho_model_limit_waits_total{key,reason}``: steps that waited before their model call on a ``ModelLimit`` key,
  by reason: ``slot``, ``requests``, ``tokens`` or ``cool-down``.
- ``lousho_model_limit_cool_downs_total{key}``: 429/529 answers with ``Retry-After`` that cooled a key down.
- ``lousho_model_slots_in_use{key}``, ``lousho_model_slots_waiting{key}`` and ``lousho_model_limit_cooling_seconds
  {key}``: slots held (or kept for a woken waiter), runs waiting in line for one, and the cool-down left, read from
  Redis at scrape time by a worker's ``/metrics`` (the fleet's figures, whatever process holds the slots).

Stays whole: every metric family of the registry side by side, so names and labels stay consistent.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine, text
from sqlalchemy.exc import SQLAlchemyError

from store import errors, interfaces, redis_client, telemetry
from store.database import Transaction, make_engine
from store.model_slots import RedisModelSlots
from store.settings import Settings

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics_core import Metric

log = logging.getLogger("lousho.metrics")

#: The variable prometheus-client reads to write each process's values to files in a shared folder.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
#: Every family, by the name a query uses (``_bucket`` and the like follow a histogram's name).
FAMILIES = (
    "lousho_runs_started_total",
    "lousho_runs_finished_total",
    "lousho_runs_awaiting_approval_total",
    "lousho_runs_parked_total",
    "lousho_runs_aborted_total",
    "lousho_steps_total",
    "lousho_step_duration_seconds",
    "lousho_model_calls_total",
    "lousho_model_tokens_total",
    "lousho_model_errors_total",
    "lousho_tool_calls_total",
    "lousho_tool_duration_seconds",
    "lousho_tool_reconciliations_total",
    "lousho_fenced_saves_total",
    "lousho_busy_drops_total",
    "lousho_sweep_resends_total",
    "lousho_schedule_fires_total",
    "lousho_schedule_skips_total",
    "lousho_schedule_misses_total",
    "lousho_webhook_deliveries_total",
    "lousho_approvals_waiting",
    "lousho_approval_oldest_age_seconds",
    "lousho_runs_unexplained",
    "lousho_doctor_look_age_seconds",
    "lousho_model_limit_waits_total",
    "lousho_model_limit_cool_downs_total",
    "lousho_model_slots_in_use",
    "lousho_model_slots_waiting",
    "lousho_model_limit_cooling_seconds",
)
#: From a mock model turn (milliseconds) to a long tool batch (minutes).
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TOOL_BUCKETS = STEP_BUCKETS
#: Outcomes of steps that did no work: counted, not timed (they would drown the steps' durations).
UNTIMED = telemetry.NO_WORK
#: How long the approvals query may take before a scrape goes on without its two gauges.
APPROVALS_TIMEOUT_MS = 2000
_LABEL_MAX = 64
_APPROVALS_TIMEOUT = text(f"SET LOCAL statement_timeout = {int(APPROVALS_TIMEOUT_MS)}")
_WAITING = text("""
SELECT count(*) AS waiting, COALESCE(EXTRACT(EPOCH FROM now() - min(created_at)), 0) AS oldest_s
FROM approvals WHERE status = 'pending' AND (expires_at IS NULL OR expires_at > now())
""")
_LATEST_LOOK = text(
    "SELECT unexplained, EXTRACT(EPOCH FROM now() - looked_at) AS age_s FROM doctor_looks WHERE name = 'i19'"
)


def available() -> bool:
    """Whether prometheus-client is installed (the ``metrics`` extra)."""
    return importlib.util.find_spec("prometheus_client") is not None


def is_multiprocess() -> bool:
    """Whether this process writes its values to the files of a multiprocess folder."""
    return bool(os.environ.get(MULTIPROC_ENV))


def _label(value: object, default: str) -> str:
    text_value = str(value) if value is not None and value != "" else default
    return text_value[:_LABEL_MAX]


class Metrics:
    """The metric families, fed by steps (``step_done``) and by sweeps, schedules and webhooks (``count``).

    With ``registry`` None the families live in a registry of their own (``self.registry``), or in no
    registry in multiprocess mode, where each process's values go to its files and ``MultiProcessCollector``
    reads them back.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        if registry is None and not is_multiprocess():
            registry = CollectorRegistry()
        self.registry = registry

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(f"lousho_{name}", doc, labels, registry=registry)

        self.runs_started = counter("runs_started", "Run inputs a step started.", "agent")
        self.runs_finished = counter("runs_finished", "Run inputs that ended finished.", "agent", "finish_reason")
        self.runs_awaiting_approval = counter(
            "runs_awaiting_approval", "Run inputs that stopped to wait for a person.", "agent"
        )
        self.runs_parked = counter(
            "runs_parked", "Steps that parked their run on a non-retryable error.", "agent", "code"
        )
        self.runs_aborted = counter("runs_aborted", "Run inputs that ended on an abort request.", "agent")
        self.steps = counter("steps", "Steps by what they did.", "agent", "kind", "outcome")
        self.step_seconds = Histogram(
            "lousho_step_duration_seconds",
            "Duration of steps that did work.",
            ("agent", "kind"),
            registry=registry,
            buckets=STEP_BUCKETS,
        )
        self.model_calls = counter("model_calls", "Model calls by outcome.", "model", "outcome")
        self.model_tokens = counter("model_tokens", "Tokens model calls reported.", "model", "direction")
        self.model_errors = counter("model_errors", "Failed model calls by error code.", "model", "code")
        self.tool_calls = counter("tool_calls", "Tool calls by outcome.", "tool", "outcome")
        self.tool_seconds = Histogram(
            "lousho_tool_duration_seconds",
            "Duration of tool calls.",
            ("tool", "outcome"),
            registry=registry,
            buckets=TOOL_BUCKETS,
        )
        self.reconciliations = counter(
            "tool_reconciliations", "Once calls reconciled after a crash, by outcome.", "tool", "outcome"
        )
        self.fenced_saves = counter("fenced_saves", "Saves refused: another holder took the run over.", "agent")
        self.busy_drops = counter("busy_drops", "Steps dropped: another process held the run's lease.")
        self.sweep_resends = counter("sweep_resends", "Steps the recovery sweep sent.")
        self.schedule_fires = counter("schedule_fires", "Schedule ticks that started a run.")
        self.schedule_skips = counter("schedule_skips", "Schedule ticks claimed without a run (overlap).")
        self.schedule_misses = counter("schedule_misses", "Overdue schedule ticks dropped by catch-up.")
        self.webhook_deliveries = counter(
            "webhook_deliveries", "Webhook deliveries by result.", "agent", "source", "result", "reason"
        )
        self.limit_waits = counter(
            "model_limit_waits", "Steps that waited on a model limit, by reason.", "key", "reason"
        )
        self.cool_downs = counter(
            "model_limit_cool_downs", "429/529 answers that cooled a model limit key down.", "key"
        )
        self._events: dict[str, Callable[[int, Mapping[str, str]], None]] = {
            "sweep.resent": lambda n, _: self.sweep_resends.inc(n),
            "schedule.fired": lambda n, _: self.schedule_fires.inc(n),
            "schedule.skipped": lambda n, _: self.schedule_skips.inc(n),
            "schedule.missed": lambda n, _: self.schedule_misses.inc(n),
            "webhook.accepted": self._webhook("accepted"),
            "webhook.duplicate": self._webhook("duplicate"),
            "webhook.refused": self._webhook("refused"),
        }
        self._unknown: set[str] = set()

    def _webhook(self, result: str) -> Callable[[int, Mapping[str, str]], None]:
        def add(amount: int, labels: Mapping[str, str]) -> None:
            self.webhook_deliveries.labels(
                _label(labels.get("agent"), ""),
                _label(labels.get("source"), ""),
                result,
                _label(labels.get("reason"), ""),
            ).inc(amount)

        return add

    def step_done(self, report: telemetry.StepReport) -> None:
        """Count what a step did: its run's transitions, its model and tool calls, and its duration."""
        agent = _label(report.agent, "unknown")
        kind = _label(report.kind, telemetry.MODEL_TURN)
        outcome = _label(report.outcome, "error")
        self.steps.labels(agent, kind, outcome).inc()
        if outcome not in UNTIMED:
            self.step_seconds.labels(agent, kind).observe(report.seconds)
        self._run_changes(report, agent, outcome)
        for model_call in report.model_calls:
            model = _label(model_call.model, "unknown")
            error = model_call.error
            result = "ok" if error is None else "cancelled" if error == "cancelled" else "error"
            self.model_calls.labels(model, result).inc()
            if result == "error":
                self.model_errors.labels(model, _label(error, "unknown")).inc()
            if model_call.input_tokens:
                self.model_tokens.labels(model, "input").inc(model_call.input_tokens)
            if model_call.output_tokens:
                self.model_tokens.labels(model, "output").inc(model_call.output_tokens)
        for tool_call in report.tool_calls:
            labels = (_label(tool_call.tool, "unknown"), _label(tool_call.outcome, "error"))
            self.tool_calls.labels(*labels).inc()
            self.tool_seconds.labels(*labels).observe(max(0, tool_call.ended_ns - tool_call.started_ns) / 1e9)
        for tool, found in report.reconciliations:
            self.reconciliations.labels(_label(tool, "unknown"), _label(found, "unknown")).inc()
        if report.waited is not None:
            self.limit_waits.labels(_label(report.limit_key, "unknown"), _label(report.waited, "unknown")).inc()
        if report.cooled:
            self.cool_downs.labels(_label(report.limit_key, "unknown")).inc()

    def _run_changes(self, report: telemetry.StepReport, agent: str, outcome: str) -> None:
        if report.input_started:
            self.runs_started.labels(agent).inc()
        if report.ended_as in ("finished", "budget-exceeded"):
            fallback = report.ended_as if report.ended_as == "budget-exceeded" else "unknown"
            self.runs_finished.labels(agent, _label(report.finish_reason, fallback)).inc()
        elif report.ended_as == "awaiting-approval":
            self.runs_awaiting_approval.labels(agent).inc()
        if report.ended_as == "aborted" or outcome == "aborted":
            self.runs_aborted.labels(agent).inc()
        if outcome == "parked":
            self.runs_parked.labels(agent, _label(report.error_code, "LOUSHO_UNKNOWN")).inc()
        elif outcome == "fenced":
            self.fenced_saves.labels(agent).inc()
        elif outcome == "busy":
            self.busy_drops.inc()

    def count(self, event: str, amount: int, labels: dict[str, str]) -> None:
        """Count ``amount`` of a ``telemetry.EVENTS`` event; an unknown name is logged once and ignored."""
        add = self._events.get(event)
        if add is not None:
            add(amount, labels)
        elif event not in self._unknown:
            self._unknown.add(event)
            log.warning("no metric counts the telemetry event %r", event)


class ApprovalsCollector:
    """The gauges read from Postgres at each scrape: approvals waiting, and the I19 checker's latest look.

    ``lousho_approvals_waiting`` and ``lousho_approval_oldest_age_seconds``; ``lousho_runs_unexplained`` and
    ``lousho_doctor_look_age_seconds`` once the checker (``store.doctor``) has looked. Read with Postgres's clock,
    so every worker and server reports the same figures whatever process wrote them. A failed query leaves the
    gauges out of that scrape (logged).
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def describe(self) -> list[Metric]:
        """Nothing: registering the collector must not query the database."""
        return []

    def collect(self) -> Iterator[Metric]:
        """The two gauges, from one query bounded by ``APPROVALS_TIMEOUT_MS``."""
        from prometheus_client.metrics_core import GaugeMetricFamily

        try:
            with Transaction(self.engine) as conn:
                conn.execute(_APPROVALS_TIMEOUT)
                row = conn.execute(_WAITING).one()
                look = conn.execute(_LATEST_LOOK).first()
        except (errors.StorageError, SQLAlchemyError) as exc:
            log.warning("approvals gauges left out of this scrape: %s", type(exc).__name__)
            return
        if look is not None:
            yield GaugeMetricFamily(
                "lousho_runs_unexplained",
                "Unfinished runs with no owner, timer or waiter past the grace, at the latest"
                " look (invariant I19; 0 when all is well).",
                value=float(look.unexplained),
            )
            yield GaugeMetricFamily(
                "lousho_doctor_look_age_seconds",
                "Seconds since the latest look of the checker.",
                value=float(look.age_s),
            )
        yield GaugeMetricFamily(
            "lousho_approvals_waiting", "Approvals and questions waiting for a person.", value=float(row.waiting)
        )
        yield GaugeMetricFamily(
            "lousho_approval_oldest_age_seconds",
            "Age of the oldest approval waiting for a person (0 when none waits).",
            value=float(row.oldest_s),
        )


class LimitsCollector:
    """The model limits' gauges, read from Redis at each scrape (``ModelSlots.usage``); left out when it fails."""

    def __init__(self, slots: interfaces.ModelSlots) -> None:
        self.slots = slots

    def describe(self) -> list[Metric]:
        """Nothing: registering the collector must not reach Redis."""
        return []

    def collect(self) -> Iterator[Metric]:
        """Slots in use, runs waiting and cool-down left, per limit key."""
        from prometheus_client.metrics_core import GaugeMetricFamily

        try:
            usage = self.slots.usage()
        except errors.StorageError as exc:
            log.warning("model limit gauges left out of this scrape: %s", exc.code)
            return
        families = [
            GaugeMetricFamily(
                "lousho_model_slots_in_use", "Model slots held or kept for a woken waiter.", labels=["key"]
            ),
            GaugeMetricFamily("lousho_model_slots_waiting", "Runs waiting in line for a model slot.", labels=["key"]),
            GaugeMetricFamily(
                "lousho_model_limit_cooling_seconds", "Seconds left of a key's cool-down.", labels=["key"]
            ),
        ]
        for found in usage:
            for family, value in zip(families, (found.in_use, found.waiting, found.cooling_s), strict=True):
                family.add_metric([_label(found.key, "unknown")], float(value))
        yield from families


class _Joined:
    """Collects from several collectors, as one (the sink's registry and the approvals gauges)."""

    def __init__(self, *parts: Any) -> None:
        self.parts = parts

    def collect(self) -> Iterator[Metric]:
        for part in self.parts:
            yield from part.collect()


def exposition(
    sink: Metrics | None, engine: Engine | None, slots: interfaces.ModelSlots | None = None
) -> CollectorRegistry:
    """The registry a scrape reads: every process's files in multiprocess mode, else ``sink``'s registry.

    Plus the approvals gauges when ``engine`` is given, and the model limits' when ``slots`` is.
    """
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry(auto_describe=False)
    if is_multiprocess():
        MultiProcessCollector(registry)  # type: ignore[no-untyped-call]  # the library leaves it unannotated
    elif sink is not None and sink.registry is not None:
        registry.register(_Joined(sink.registry))
    if engine is not None:
        registry.register(ApprovalsCollector(engine))
    if slots is not None:
        registry.register(LimitsCollector(slots))
    return registry


def render(sink: Metrics | None, engine: Engine | None, accept: str | None = None) -> tuple[bytes, str]:
    """A scrape's body and content type (OpenMetrics when ``accept`` asks for it), for an HTTP route."""
    from prometheus_client.exposition import choose_encoder

    encode, content_type = choose_encoder(accept or "")
    return encode(exposition(sink, engine)), content_type


def make_sink() -> Metrics | None:
    """The sink of a process that serves its own ``/metrics`` (the HTTP server); None without prometheus-client."""
    if not available():
        log.info("prometheus-client is not installed (the metrics extra): no /metrics")
        return None
    return Metrics()


def prepare(settings: Settings) -> Path:
    """Make the multiprocess folder ready, before a prefork worker's pool forks; returns the folder.

    The folder is ``LOUSHO_METRICS_DIR``, else ``PROMETHEUS_MULTIPROC_DIR``, else a new temporary folder.
    Value files left by an earlier start are deleted (a restarted worker's counters start from zero, which
    Prometheus reads as a reset), so one folder must serve one worker only.

    prometheus-client picks in-memory or file values when it is first imported, and the ``celery`` command
    may import it before any of our code runs (Flower's command plugin does). Metrics made from here on then
    get file values all the same: the library's value class is switched to its multiprocess one, as its own
    ``MultiProcessValue`` factory allows; metrics made before (another library's) keep their memory values.

    Raises:
        ConfigurationError: the folder cannot be made, or the installed prometheus-client has no multiprocess
            value class to switch to.
    """
    folder = Path(settings.metrics_dir or os.environ.get(MULTIPROC_ENV) or tempfile.mkdtemp(prefix="lousho-metrics-"))
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob("*.db"):
            stale.unlink(missing_ok=True)
    except OSError as exc:
        raise errors.ConfigurationError(f"metrics folder {folder} unusable: {type(exc).__name__}") from exc
    os.environ[MULTIPROC_ENV] = str(folder)
    if "prometheus_client.values" in sys.modules:
        from prometheus_client import values

        if not getattr(values.ValueClass, "_multiprocess", False):
            if not hasattr(values, "MultiProcessValue"):
                raise errors.ConfigurationError(
                    f"prometheus_client was imported before {MULTIPROC_ENV} was set and"
                    " has no multiprocess values to switch to; set it in the environment"
                )
            values.ValueClass = values.MultiProcessValue()  # type: ignore[no-untyped-call]  # unannotated factory
            log.info("prometheus_client was imported before the metrics folder was set; switched to its file values")
    return folder


def serve(
    port: int,
    engine: Engine | None,
    sink: Metrics | None = None,
    addr: str = "0.0.0.0",
    slots: interfaces.ModelSlots | None = None,
) -> int:
    """Serve ``/metrics`` on ``addr:port`` from a daemon thread; returns the port bound (``port`` 0 picks one).

    Raises:
        OSError: the port cannot be bound.
    """
    from prometheus_client import start_http_server

    server, _ = start_http_server(port, addr=addr, registry=exposition(sink, engine, slots))
    bound = int(server.server_port)
    log.info("metrics served on %s:%d/metrics", addr, bound)
    return bound


def enable_worker(settings: Settings, engine: Engine | None = None) -> bool:
    """In a worker's parent, before the pool forks: count every pool process's steps and serve them.

    Does nothing without ``LOUSHO_METRICS_PORT``. Otherwise sets up the multiprocess folder, attaches the
    sink (the pool processes inherit it) and serves ``/metrics`` on that port with the approvals gauges
    (queried through ``engine``, by default one that keeps no connection between scrapes, so no pool
    process inherits one). Returns whether metrics are on; a problem is logged, never raised: metrics
    must not keep a worker from running steps.
    """
    if settings.metrics_port is None:
        return False
    if not available():
        log.error(
            "LOUSHO_METRICS_PORT is set but prometheus-client is not installed (pip install"
            " 'lousho-worker[metrics]'): no metrics"
        )
        return False
    try:
        folder = prepare(settings)
    except errors.ConfigurationError as exc:
        log.error("metrics off: %s", exc)
        return False
    sink = Metrics()
    telemetry.attach(sink)
    try:
        # Redis clients connect on first use (a scrape), so no pool process inherits a connection.
        slots = RedisModelSlots(
            redis_client.connect(settings, socket_timeout=2, socket_connect_timeout=2), settings.lease_ttl_ms
        )
        serve(settings.metrics_port, engine if engine is not None else make_engine(settings, pooled=False), slots=slots)
    except OSError as exc:
        telemetry.detach(sink)
        log.error("metrics off: port %d cannot be served (%s)", settings.metrics_port, exc)
        return False
    log.info("metrics of every pool process kept in %s", folder)
    return True


def mark_dead(pid: int) -> None:
    """Forget the live-only values of a pool process that exited (``worker_process_shutdown``); counts stay."""
    if not is_multiprocess() or "prometheus_client" not in sys.modules:
        return
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]  # the library leaves it unannotated


__all__ = [
    "FAMILIES",
    "MULTIPROC_ENV",
    "ApprovalsCollector",
    "LimitsCollector",
    "Metrics",
    "available",
    "enable_worker",
    "exposition",
    "is_multiprocess",
    "make_sink",
    "mark_dead",
    "prepare",
    "render",
    "serve",
]
