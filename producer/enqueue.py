"""Sending ``advance`` messages from producer processes, by task name (no worker import).

One Celery app per client, reusing its pooled broker connection for every send.
"""

from __future__ import annotations

import kombu.exceptions
from celery import Celery

from store import errors, redis_client, step_message, telemetry
from store.settings import Settings


class Enqueuer:
    """Publishes step messages (ids only, JSON) to the runs' queue."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        _, broker_extra = redis_client.celery_broker_options(settings)
        self._app = Celery("lousho-producer", set_as_current=False)
        self._app.conf.update(
            broker_url=settings.broker,
            task_serializer="json",
            accept_content=["json"],
            task_ignore_result=True,
            result_backend=None,
            # A task-sent event per step sent, as the workers send for theirs: Flower lists a step from when it
            # is queued.
            task_send_sent_event=settings.task_events,
            broker_connection_retry_on_startup=True,
            task_publish_retry=True,
            task_publish_retry_policy={"max_retries": 5, "interval_start": 0, "interval_step": 0.5, "interval_max": 2},
            broker_transport_options=step_message.broker_options(settings),
            **broker_extra,
        )
        telemetry.name_sent_events(self._app)

    @redis_client.translated  # kombu lets some of the Redis transport's errors through unwrapped
    def advance(
        self, session_id: str, seq: int | None = None, agent: str | None = None, *, kind: str = telemetry.NEW_INPUT
    ) -> None:
        """Ask a worker for the next step of ``session_id`` (on ``agent``'s queue when known).

        ``kind`` says why (``store.telemetry`` kinds): the step's name in Flower is ``"<agent>: <kind>"``. A lost
        message is repaired by the sweep.

        Raises:
            StorageError: the broker could not be reached (the input is already durable: the
                recovery sweep sends the step once the broker is back).
        """
        try:
            self._app.send_task(
                step_message.ADVANCE,
                kwargs=step_message.arguments(session_id, seq),
                **step_message.routing(self._settings, agent, kind=kind),
            )
        except (kombu.exceptions.OperationalError, OSError) as exc:
            raise errors.StorageError(f"broker unavailable: {type(exc).__name__}") from exc

    def close(self) -> None:
        """Release the broker connections."""
        self._app.close()
