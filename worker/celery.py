"""The Celery app (``celery -A worker worker|beat|flower`` finds it here), ``install(app)`` for a team's own app, beat.

Importing this module changes nothing in the process: ``app`` and ``settings`` are made on first use (the entry
points: the ``celery`` command, the worker, beat, Flower), and the logging, redaction and signal hooks are set up
there. Each setting below exists for a reason listed in RELIABILITY.md section 2; the comments name the Celery or
kombu issue behind the ones that guard against known bugs.

Stays whole: every Celery setting Lousho needs, for its own app and for a team's (``install``), side by side.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any

from celery import Celery, signals
from celery.utils.imports import import_from_cwd
from kombu import Queue  # type: ignore[attr-defined]  # kombu does not list Queue in __all__

from store import errors, logs, redaction, redis_client, step_message, telemetry
from store.settings import Settings, load_settings
from worker import starts

log = logging.getLogger("lousho.celery")

#: Lousho's tasks; what a task can carry (serializer, acks, time limits, queue) is set on each in ``worker.tasks``.
TASKS = (step_message.ADVANCE, "lousho.recover", "lousho.schedules", "lousho.prune", "lousho.doctor", starts.START_TASK)
#: The sweeps beat sends.
SWEEPS = frozenset({"lousho.recover", "lousho.schedules", "lousho.prune", "lousho.doctor"})
#: The module ``install`` adds to an app's ``include``: it defines the tasks.
TASKS_MODULE = "worker.tasks"

#: This process's settings: the app's configuration and the tasks read them (``ConfigurationError`` if invalid).
#: Read from the ``LOUSHO_`` environment on first use, not at import.
settings: Settings
#: The app ``celery -A worker`` finds, made on first use (``create_app``) with the process's log redaction.
app: Celery

_lazy_lock = threading.RLock()
#: Apps ``install`` was given, with the settings it used: the worker and beat hooks act only for these.
_installed: weakref.WeakKeyDictionary[Celery, Settings] = weakref.WeakKeyDictionary()


def __getattr__(name: str) -> Any:
    """Make ``settings`` and ``app`` on first use, once per process."""
    if name not in ("settings", "app"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    with _lazy_lock:
        if name not in globals():
            if name == "settings":
                globals()["settings"] = load_settings()
            else:
                # The entry points reach the app through here: every process that runs it masks secrets in its
                # logs and uncaught exceptions from now on.
                redaction.install()
                globals()["app"] = create_app(__getattr__("settings"))
        return globals()[name]


def control_queue(settings: Settings) -> str:
    """The queue of the recover, schedule and retention sweeps."""
    return f"{settings.queue}-control"


def queue_names(settings: Settings) -> tuple[str, ...]:
    """Lousho's own queues: the shared step queue, the sweeps' queue and the start queue (agents' queues aside)."""
    return settings.queue, control_queue(settings), starts.start_queue(settings.queue)


def worker_options(settings: Settings) -> dict[str, Any]:
    """What Celery applies to a whole worker, as a worker that consumes Lousho's queues must have it.

    Set on the app when such a worker starts (``install``'s worker hook), for every task that worker runs.
    """
    return {
        # JSON only: a pickle message in the queue is refused, never run.
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        # Reserved messages age against the visibility timeout, and all are stranded when a worker is killed.
        "worker_prefetch_multiplier": 1,
        # A step that lost the broker connection cannot ack; cancel it (celery PR#6654, default in 6.0).
        "worker_cancel_long_running_tasks_on_connection_loss": True,
        "worker_soft_shutdown_timeout": 10.0,
        "broker_transport_options": step_message.broker_options(settings),
        # The visibility timeout must be the same everywhere or the shortest wins (celery#7651).
        "result_backend_transport_options": {"visibility_timeout": settings.visibility_timeout_s},
        "broker_connection_retry_on_startup": True,
        "broker_connection_max_retries": None,
    }


def configure(app: Celery, settings: Settings) -> None:
    """Give ``app`` the whole production configuration: the app ``celery -A worker`` runs is Lousho's alone.

    ``install`` is what a team's own app gets instead: it merges and keeps the app's own settings.

    Raises:
        ConfigurationError: a Sentinel broker without its master's name, or a malformed broker URL.
    """
    _, broker_extra = redis_client.celery_broker_options(settings)
    control, start = control_queue(settings), starts.start_queue(settings.queue)
    app.conf.update(
        broker_url=settings.broker,
        task_serializer="json",
        result_serializer="json",
        event_serializer="json",
        # Redeliver a step whose process died (celery#1628); the attempts cap stops message loops.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        # Failures are recorded in Postgres and retried by our bounded logic, not by broker loops.
        task_acks_on_failure=True,
        task_acks_on_timeout=True,
        task_soft_time_limit=settings.step_soft_time_limit_s,
        task_time_limit=settings.step_time_limit_s,
        task_publish_retry=True,
        task_publish_retry_policy={"max_retries": 5, "interval_start": 0, "interval_step": 0.5, "interval_max": 2},
        # State lives in Postgres; tasks store no results, but for ``lousho.start``'s run id where
        # LOUSHO_RESULT_BACKEND names a backend for its callers.
        task_ignore_result=True,
        result_backend=settings.result_backend,
        enable_utc=True,
        timezone="UTC",
        task_default_queue=settings.queue,
        # The sweeps get a queue of their own, consumed by every worker next to the steps' queue: a
        # backlog of steps (exactly when workers were lost) must not delay the sweep that recovers runs.
        task_queues=[Queue(name) for name in queue_names(settings)],
        task_routes={
            "lousho.recover": {"queue": control},
            "lousho.schedules": {"queue": control},
            "lousho.prune": {"queue": control},
            "lousho.doctor": {"queue": control},
            starts.START_TASK: {"queue": start},
        },
        # Task events, from workers and senders: Flower lists every step, including the ones that waited in a
        # queue or ran before it started (it turns worker events on by itself only while it runs).
        worker_send_task_events=settings.task_events,
        task_send_sent_event=settings.task_events,
        worker_hijack_root_logger=False,
        # On or off as a whole: Flower needs it, and with it anyone on the broker can stop workers.
        worker_enable_remote_control=settings.remote_control,
        beat_schedule=beat_schedule(settings),
        **worker_options(settings),
        **broker_extra,
    )


def beat_schedule(settings: Settings) -> dict[str, dict[str, Any]]:
    """The sweeps beat sends: recovery, schedules, the I19 checker, and retention once ``LOUSHO_RETENTION_DAYS`` is set.

    Each names its queue, so a beat of an app whose routes do not know Lousho's tasks sends them where workers
    consume them.
    """
    control = control_queue(settings)
    entries: dict[str, dict[str, Any]] = {
        "lousho-recover": {
            "task": "lousho.recover",
            "schedule": settings.recover_interval_s,
            "options": {"queue": control, "expires": max(settings.recover_interval_s * 2, 2.0)},
        },
        # Only claims ticks in Postgres: a second beat (always there during a deploy) fires nothing twice.
        "lousho-schedules": {
            "task": "lousho.schedules",
            "schedule": settings.schedule_interval_s,
            "options": {"queue": control, "expires": max(settings.schedule_interval_s * 2, 2.0)},
        },
    }
    if settings.doctor_interval_s > 0:
        # Only reads and keeps its verdict in Postgres: two beats' looks agree.
        entries["lousho-doctor"] = {
            "task": "lousho.doctor",
            "schedule": settings.doctor_interval_s,
            "options": {"queue": control, "expires": max(settings.doctor_interval_s, 2.0)},
        }
    if settings.retention_days is not None:
        # Bounded passes (store.retention.sweep); the passes of two beats share the work.
        entries["lousho-prune"] = {
            "task": "lousho.prune",
            "schedule": settings.retention_interval_s,
            "options": {"queue": control, "expires": max(settings.retention_interval_s, 2.0)},
        }
    return entries


def check_configuration(app: Celery) -> None:
    """Refuse to run Lousho's steps with settings that break the guarantees (pickle, early acks, prefetch).

    Reads what a worker applies to all its tasks from the configuration, and what a task carries from Lousho's
    tasks once the app has them (``app.finalized``).

    Raises:
        ConfigurationError: the message lists every problem.
    """
    conf = app.conf
    problems = []
    if set(conf.accept_content or []) != {"json"}:
        problems.append("only JSON may be accepted (accept_content)")
    if conf.worker_prefetch_multiplier != 1:
        problems.append("worker_prefetch_multiplier must be 1")
    time_limit = conf.task_time_limit
    if app.finalized:
        for name in TASKS:
            task = app.tasks.get(name)
            if task is None:
                continue
            time_limit = task.time_limit or time_limit
            if task.serializer != "json":
                problems.append(f"{name} must be sent as JSON")
            if not (task.acks_late and task.reject_on_worker_lost):
                problems.append(f"{name} must have acks_late and reject_on_worker_lost on")
    elif conf.task_serializer != "json" or not (conf.task_acks_late and conf.task_reject_on_worker_lost):
        problems.append("tasks must be sent as JSON with task_acks_late and task_reject_on_worker_lost on")
    visibility = (conf.broker_transport_options or {}).get("visibility_timeout", 3600)
    if time_limit and visibility < 2 * time_limit:
        problems.append("visibility_timeout must be at least twice the step time limit")
    if problems:
        raise errors.ConfigurationError("unsafe Celery configuration: " + "; ".join(dict.fromkeys(problems)))


def install(app: Celery, settings: Settings | None = None) -> Celery:
    """Add Lousho to ``app`` and keep everything the app had; returns ``app``.

    Call it after the app's own configuration is loaded. What is added: Lousho's tasks (``worker.tasks`` joins
    ``include``; each task carries its own serializer, acks, time limits and queue), Lousho's queues next to the
    app's (the app's default queue stays consumed), and the sweeps' beat entries next to the app's. Kept as they
    were: the broker (used as is; set from the settings only when the app has none), the result backend, the
    default queue, the time zone, the global time limits, the routes, the queues, the beat entries and
    ``include``. What Celery applies to a whole worker (prefetch 1, JSON only, the visibility and shutdown
    settings) is applied when a worker of this app that consumes Lousho's queues starts: give Lousho's queues a
    worker of its own (``-Q``) when the app's other tasks need other values.

    ``settings`` defaults to this process's (``worker.celery.settings``), the ones the tasks read.

    Raises:
        ConfigurationError: the app's configuration breaks a guarantee that cannot be scoped to Lousho's tasks:
            a broker other than ``LOUSHO_BROKER_URL``, or a broker visibility timeout too short for a step
            (every worker on the broker restores unacked messages older than its own value). The message names
            the setting.
    """
    settings = settings if settings is not None else __getattr__("settings")
    conf = app.conf
    transport, broker_extra = redis_client.celery_broker_options(settings)
    host_broker = conf.broker_url
    # Checked before anything changes: a refused app is left as it was.
    if host_broker and settings.broker_url is not None and host_broker != settings.broker_url:
        raise errors.ConfigurationError(
            "the app's broker_url is not LOUSHO_BROKER_URL: producers and the sweep would send steps where this"
            " app's workers do not read; make them the same (or leave LOUSHO_BROKER_URL unset to use the app's)",
            variable="LOUSHO_BROKER_URL",
            field="broker_url",
        )
    visibility = (conf.broker_transport_options or {}).get("visibility_timeout")
    if visibility is not None and visibility < 2 * settings.step_time_limit_s:
        raise errors.ConfigurationError(
            f"the app's broker_transport_options visibility_timeout ({visibility} s) is under twice"
            f" LOUSHO_STEP_TIME_LIMIT_S ({settings.step_time_limit_s:g} s): every worker on this broker would"
            " deliver a running step a second time",
            field="broker_transport_options",
        )
    if not host_broker:
        conf.broker_url = settings.broker
        conf.broker_transport_options = {**transport, **(conf.broker_transport_options or {})}
        for key, value in broker_extra.items():
            if conf.get(key) is None:
                conf[key] = value
    conf.task_queues = _merged_queues(app, settings)
    conf.beat_schedule = {**beat_schedule(settings), **(conf.beat_schedule or {})}
    include = list(conf.include or ())
    if TASKS_MODULE not in include:
        conf.include = [*include, TASKS_MODULE]
    telemetry.name_sent_events(app)
    _quiet_sweeps(app)
    _installed[app] = settings
    _connect_hooks()
    return app


def _merged_queues(app: Celery, settings: Settings) -> list[Queue] | dict[str, Any]:
    """The app's queues with Lousho's added; an app without ``task_queues`` keeps consuming its default queue."""
    existing = app.conf.task_queues
    if isinstance(existing, Mapping):
        return {**{name: {"routing_key": name} for name in queue_names(settings)}, **existing}
    if existing:
        queues = list(existing)
    else:
        default = app.conf.task_default_queue
        queues = [Queue(default, exchange=app.amqp.default_exchange, routing_key=app.conf.task_default_routing_key)]
    present = {queue.name for queue in queues}
    return queues + [Queue(name) for name in queue_names(settings) if name not in present]


def create_app(settings: Settings | None = None) -> Celery:
    """A new Celery app named ``lousho`` with the whole production configuration, set up by ``install``.

    Raises:
        ConfigurationError: the settings make an unsafe configuration.
    """
    settings = settings if settings is not None else __getattr__("settings")
    made = Celery("lousho")
    configure(made, settings)
    check_configuration(made)
    return install(made, settings)


def installed_settings(app: Celery) -> Settings | None:
    """The settings ``install`` gave ``app``; None when Lousho is not installed in it."""
    return _installed.get(app)


def serves_lousho(worker: Any) -> bool:
    """Whether a starting worker (Celery's ``WorkController``) runs Lousho's steps.

    True when its app has Lousho installed and it consumes one of Lousho's queues (an agent's included): a
    worker of a team's app started with ``-Q`` on the team's queues only is left as it is.
    """
    settings = installed_settings(worker.app)
    if settings is None:
        return False
    own = set(queue_names(settings))
    consumed = set(worker.app.amqp.queues.consume_from)
    return any(name in own or name.startswith(f"{settings.queue}.") for name in consumed)


def _connect_hooks() -> None:
    """Connect the worker and beat hooks, once per process (by the first ``install``, never at import)."""
    signals.worker_init.connect(_prepare_worker, weak=False, dispatch_uid="lousho.prepare_worker")
    signals.before_task_publish.connect(_stamp_start, weak=False, dispatch_uid="lousho.stamp_start")
    signals.beat_init.connect(_prepare_beat, weak=False, dispatch_uid="lousho.prepare_beat")
    signals.after_setup_logger.connect(_redact_logs, weak=False, dispatch_uid="lousho.redact_logs")
    signals.after_setup_task_logger.connect(_redact_logs, weak=False, dispatch_uid="lousho.redact_task_logs")


def _prepare_worker(sender: Any = None, **_: Any) -> None:
    """A worker that runs Lousho's steps gets the worker-wide settings they need, before it consumes.

    Prefetch was read from the configuration already (Celery reads it before this signal): it is set on the
    worker too. A worker that also consumes other queues applies them to those tasks as well, and says so.
    """
    if sender is None or not serves_lousho(sender):
        return
    settings = installed_settings(sender.app)
    assert settings is not None  # serves_lousho checked it
    wanted = worker_options(settings)
    conf = sender.app.conf
    changed = sorted(
        name for name, value in wanted.items() if name != "broker_transport_options" and conf.get(name) != value
    )
    wanted["broker_transport_options"] = {**(conf.broker_transport_options or {}), **wanted["broker_transport_options"]}
    conf.update(wanted)
    sender.prefetch_multiplier = 1
    check_configuration(sender.app)
    others = sorted(
        name
        for name in sender.app.amqp.queues.consume_from
        if name not in queue_names(settings) and not name.startswith(f"{settings.queue}.")
    )
    if others and changed:
        log.warning(
            "this worker also consumes %s: Lousho's worker settings (%s) apply to their tasks too; give"
            " Lousho's queues a worker of their own (-Q %s) to keep the app's values there",
            ", ".join(others),
            ", ".join(changed),
            ",".join(queue_names(settings)),
        )


def _stamp_start(sender: str | None = None, headers: dict[str, Any] | None = None, **_: Any) -> None:
    """Stamp each ``lousho.start`` message with the time it is sent (a beat's tick is read from it)."""
    if sender == starts.START_TASK and headers is not None:
        headers.setdefault(starts.SENT_AT_HEADER, time.time())


def _quiet_sweeps(app: Celery) -> None:
    """Send no task-sent event for the sweeps ``app`` sends (beat, every few seconds): they would flood Flower.

    Steps, which workers and producers send, keep theirs; the sweep tasks send no events either
    (``worker.tasks``). Scoped to the sweeps' messages, so the app's own tasks keep the app's setting.
    """
    create = app.amqp.create_task_message
    if getattr(create, "quiets_sweeps", False):
        return

    def create_quiet(task_id: str, name: str, *args: Any, **kwargs: Any) -> Any:
        message = create(task_id, name, *args, **kwargs)
        if name in SWEEPS and message.sent_event is not None:
            return message._replace(sent_event=None)
        return message

    create_quiet.quiets_sweeps = True  # type: ignore[attr-defined]
    app.amqp.create_task_message = create_quiet


def _prepare_beat(sender: Any = None, **_: Any) -> None:
    """A beat of an app with Lousho installed adds the entries of ``LOUSHO_BEAT_MODULES`` before its first tick.

    Beat built its schedule from the configuration already (this signal comes after): the entries go to both.
    A module that cannot be read stops the beat, rather than letting it run without the entries.
    """
    settings = installed_settings(sender.app) if sender is not None else None
    if settings is None:
        return
    try:
        entries = beat_module_entries(settings)
    except errors.ConfigurationError as exc:
        log.critical("beat cannot start: %s", exc)
        raise SystemExit(1) from exc
    if entries:
        sender.app.conf.beat_schedule = {**(sender.app.conf.beat_schedule or {}), **entries}
        sender.scheduler.update_from_dict(entries)
        log.info("beat entries from LOUSHO_BEAT_MODULES: %s", ", ".join(sorted(entries)))


def beat_module_entries(settings: Settings) -> dict[str, dict[str, Any]]:
    """The ``beat_schedule`` dicts of the modules in ``LOUSHO_BEAT_MODULES``, merged in the order named.

    Like ``celery -A``, modules next to where the beat was started are importable.

    Raises:
        ConfigurationError: a module cannot be imported, has no ``beat_schedule`` dict, or two define one name.
    """
    merged: dict[str, dict[str, Any]] = {}
    for name in settings.beat_module_names:
        try:
            module = import_from_cwd(name)
        except ImportError as exc:
            raise errors.ConfigurationError(
                f"LOUSHO_BEAT_MODULES names {name!r}, which cannot be imported: {exc}", variable="LOUSHO_BEAT_MODULES"
            ) from exc
        entries = getattr(module, "beat_schedule", None)
        if not isinstance(entries, Mapping):
            raise errors.ConfigurationError(
                f"module {name!r} of LOUSHO_BEAT_MODULES has no beat_schedule dict", variable="LOUSHO_BEAT_MODULES"
            )
        for entry_name, entry in entries.items():
            if entry_name in merged:
                raise errors.ConfigurationError(
                    f"beat entry {entry_name!r} is defined twice in LOUSHO_BEAT_MODULES", variable="LOUSHO_BEAT_MODULES"
                )
            merged[entry_name] = dict(entry)
    return merged


def _redact_logs(logger: Any = None, **_: Any) -> None:
    """Mask secret-shaped text in every worker and beat log line; JSON lines when ``LOUSHO_LOG_FORMAT=json``."""
    redaction.install(logger)
    if __getattr__("settings").log_format == "json":
        logs.use_json(logger)


__all__ = [
    "TASKS",
    "beat_module_entries",
    "beat_schedule",
    "check_configuration",
    "configure",
    "control_queue",
    "create_app",
    "install",
    "installed_settings",
    "queue_names",
    "serves_lousho",
    "worker_options",
]
