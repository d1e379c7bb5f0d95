"""A team's own Celery app with Lousho installed, for ``tests/crash/test_host_app.py``.

Its own broker (the one ``LOUSHO_BROKER_URL`` names, or its own URL with that setting unset), result backend,
default queue, queues, routes, beat entry, time zone and time limits, and one task of its own on its own queue;
``install(app)`` adds Lousho. ``celery -A tests.support.host_app worker`` runs both kinds of task.
"""

from __future__ import annotations

import os

from celery import Celery
from kombu import Queue  # type: ignore[attr-defined]  # kombu does not list Queue in __all__

from worker.celery import install
from worker.starts import beat_entry

#: Where the app's broker and backend are (the test Redis db); the test sets it.
URL_ENV = "HOST_APP_REDIS_URL"

app = Celery("billing")
app.conf.update(
    broker_url=os.environ[URL_ENV],
    result_backend=os.environ[URL_ENV],
    task_default_queue="billing",
    task_queues=[Queue("billing"), Queue("billing-slow")],  # type: ignore[no-untyped-call]  # kombu is untyped
    task_routes={"billing.slow_*": {"queue": "billing-slow"}},
    beat_schedule={
        "invoices": {"task": "billing.invoice", "schedule": 3600.0, "args": ("nightly",)},
        # A run of the start tests' agent every 2 s, however many of the app's beats run.
        "host-ticks": beat_entry("host-ticks", "starter", "from the team's beat", 2.0),
    },
    timezone="Europe/Paris",
    task_time_limit=900,
    task_soft_time_limit=600,
)


@app.task(name="billing.invoice")  # type: ignore[untyped-decorator]  # celery is untyped
def invoice(order: str) -> str:
    """The app's own task: answers on the app's queue, through the app's result backend."""
    return f"invoiced {order}"


install(app)
