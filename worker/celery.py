"""The Celery app (``celery -A worker worker|beat|flower`` finds it here), its configuration and beat.

Each setting below exists for a reason listed in RELIABILITY.md section 2; the comments name the
Celery or kombu issue behind the ones that guard against known bugs.
"""

from __future__ import annotations

import time
from typing import Any

from celery import Celery, signals
from kombu import Queue  # type: ignore[attr-defined]  # kombu does not list Queue in __all__

from store import logs, redaction, redis_client, telemetry
from store.settings import Settings, load_settings
from worker import starts


def broker_options(settings: Settings) -> dict[str, Any]:
    """Redis transport options shared by the broker and result sides (one visibility timeout)."""
    return {
        # Only late duplicates depend on it; recovery is our sweep (celery#5935, kombu PR#2558).
        "visibility_timeout": settings.visibility_timeout_s,
        "unacked_restore_interval": 10,
        "unacked_restore_throttle": 1,
        "health_check_interval": 10,
        "socket_timeout": 15,
        "socket_connect_timeout": 5,
        "socket_keepalive": True,
        "retry_on_timeout": True,
    }


def control_queue(settings: Settings) -> str:
    """The queue of the recover, schedule and retention sweeps."""
    return f"{settings.queue}-control"


def configure(app: Celery, settings: Settings) -> None:
    """Apply the production configuration to ``app``.

    Raises:
        ConfigurationError: a Sentinel broker without its master's name, or a malformed broker URL.
    """
    transport, broker_extra = redis_client.celery_broker_options(settings)
    options = {**broker_options(settings), **transport}
    app.conf.update(
        broker_url=settings.broker,
        # JSON only, sent and accepted: a pickle message in the queue is refused, never run.
        task_serializer="json",
        result_serializer="json",
        event_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        # Redeliver a step whose process died (celery#1628); the attempts cap stops message loops.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        # Failures are recorded in Postgres and retried by our bounded logic, not by broker loops.
        task_acks_on_failure=True,
        task_acks_on_timeout=True,
        worker_prefetch_multiplier=1,
        # A step that lost the broker connection cannot ack; cancel it (celery PR#6654, default in 6.0).
        worker_cancel_long_running_tasks_on_connection_loss=True,
        worker_soft_shutdown_timeout=10.0,
        task_soft_time_limit=settings.step_soft_time_limit_s,
        task_time_limit=settings.step_time_limit_s,
        broker_transport_options=options,
        # The visibility timeout must be the same everywhere or the shortest wins (celery#7651).
        result_backend_transport_options={"visibility_timeout": settings.visibility_timeout_s},
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        task_publish_retry=True,
        task_publish_retry_policy={"max_retries": 5, "interval_start": 0, "interval_step": 0.5,
                                   "interval_max": 2},
        # State lives in Postgres; tasks return None and store no results.
        task_ignore_result=True,
        result_backend=None,
        enable_utc=True,
        timezone="UTC",
        task_default_queue=settings.queue,
        # The sweeps get a queue of their own, consumed by every worker next to the steps' queue: a
        # backlog of steps (exactly when workers were lost) must not delay the sweep that recovers runs.
        task_queues=[Queue(settings.queue), Queue(control_queue(settings)), Queue(starts.start_queue(settings.queue))],
        task_routes={"lousho.recover": {"queue": control_queue(settings)},
                     "lousho.schedules": {"queue": control_queue(settings)},
                     "lousho.prune": {"queue": control_queue(settings)},
                     starts.START_TASK: {"queue": starts.start_queue(settings.queue)}},
        # Task events, from workers and senders: Flower lists every step, including the ones that waited in a
        # queue or ran before it started (it turns worker events on by itself only while it runs).
        worker_send_task_events=settings.task_events,
        task_send_sent_event=settings.task_events,
        worker_hijack_root_logger=False,
        # On or off as a whole: Flower needs it, and with it anyone on the broker can stop workers.
        worker_enable_remote_control=settings.remote_control,
        beat_schedule=beat_schedule(settings),
        **broker_extra,
    )


def beat_schedule(settings: Settings) -> dict[str, dict[str, Any]]:
    """The sweeps beat sends: recovery, schedules, and retention once ``LOUSHO_RETENTION_DAYS`` is set."""
    entries: dict[str, dict[str, Any]] = {
        "lousho-recover": {"task": "lousho.recover", "schedule": settings.recover_interval_s,
                           "options": {"expires": max(settings.recover_interval_s * 2, 2.0)}},
        # Only claims ticks in Postgres: a second beat (always there during a deploy) fires nothing twice.
        "lousho-schedules": {"task": "lousho.schedules", "schedule": settings.schedule_interval_s,
                             "options": {"expires": max(settings.schedule_interval_s * 2, 2.0)}},
    }
    if settings.retention_days is not None:
        # Bounded passes (store.retention.sweep); the passes of two beats share the work.
        entries["lousho-prune"] = {"task": "lousho.prune", "schedule": settings.retention_interval_s,
                                   "options": {"expires": max(settings.retention_interval_s, 2.0)}}
    return entries


def check_configuration(app: Celery) -> None:
    """Refuse to start with settings that break the guarantees (pickle, early acks, prefetch)."""
    conf = app.conf
    problems = []
    if set(conf.accept_content or []) != {"json"} or conf.task_serializer != "json":
        problems.append("only JSON may be sent and accepted")
    if not (conf.task_acks_late and conf.task_reject_on_worker_lost):
        problems.append("task_acks_late and task_reject_on_worker_lost must both be on")
    if conf.worker_prefetch_multiplier != 1:
        problems.append("worker_prefetch_multiplier must be 1")
    visibility = (conf.broker_transport_options or {}).get("visibility_timeout", 3600)
    if conf.task_time_limit and visibility < 2 * conf.task_time_limit:
        problems.append("visibility_timeout must be at least twice task_time_limit")
    if problems:
        raise RuntimeError("unsafe Celery configuration: " + "; ".join(problems))


def install(app: Celery) -> Celery:
    """Make ``app`` run Lousho steps: the production configuration, the sweeps' beat entries and the tasks.

    Works on the app ``celery -A worker`` finds and on an application's own Celery app alike
    (``install(my_app)`` next to its own tasks); returns ``app``. The configuration comes from this
    process's settings (``settings``, read from the ``LOUSHO_`` environment once), the same ones the
    tasks use, so the app and its tasks never disagree on queues or timings.

    Raises:
        RuntimeError: the resulting configuration would break the delivery guarantees.
    """
    # Every process that builds an app (worker, beat, flower) masks secrets in its logs from here on.
    redaction.install()
    configure(app, settings)
    check_configuration(app)
    app.conf.include = [*(app.conf.include or ()), "worker.tasks"]
    telemetry.name_sent_events(app)
    return app


def create_app() -> Celery:
    """A new Celery app named ``lousho``, set up by ``install``."""
    return install(Celery("lousho"))


#: This process's settings: the app's configuration and the tasks read them (``ConfigurationError`` if invalid).
settings = load_settings()
#: The app ``celery -A worker`` finds; building it reads the settings and touches no service.
app = create_app()


@signals.before_task_publish.connect
def _stamp_start(sender: str | None = None, headers: dict[str, Any] | None = None, **_: Any) -> None:
    """Stamp each ``lousho.start`` message with the time it is sent (a beat's tick is read from it)."""
    if sender == starts.START_TASK and headers is not None:
        headers.setdefault(starts.SENT_AT_HEADER, time.time())


@signals.beat_init.connect
def _quiet_beat(sender: Any = None, **_: Any) -> None:
    """Beat sends no task-sent events: the sweeps it sends every few seconds would flood Flower's task list.

    Steps, which workers and producers send, keep theirs; the sweep tasks send no events either (``worker.tasks``).
    """
    if sender is not None:
        sender.app.conf.task_send_sent_event = False


@signals.after_setup_logger.connect
@signals.after_setup_task_logger.connect
def _redact_logs(logger: Any = None, **_: Any) -> None:
    """Mask secret-shaped text in every worker and beat log line; JSON lines when ``LOUSHO_LOG_FORMAT=json``."""
    redaction.install(logger)
    if settings.log_format == "json":
        logs.use_json(logger)
