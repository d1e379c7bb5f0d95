"""The step message has one owner: what the producer sends for new input is what a worker sends after a step."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from celery.utils.saferepr import saferepr

from producer import enqueue
from store import step_message, telemetry
from tests.support import services
from worker import celery as lousho_celery
from worker import tasks


def _captured(monkeypatch: pytest.MonkeyPatch, target: Any, attribute: str) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    def capture(*args: Any, **kwargs: Any) -> None:
        sent.append({"args": args, **kwargs})

    monkeypatch.setattr(target, attribute, capture)
    return sent


def test_the_producer_and_the_worker_send_the_same_message_with_the_same_broker_options(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = services.test_settings()
    sender = enqueue.Enqueuer(settings)
    try:
        from_producer = _captured(monkeypatch, sender._app, "send_task")
        sender.advance("m-1", 4, "shop", kind=telemetry.NEW_INPUT)
        producer_options = sender._app.conf.broker_transport_options
    finally:
        sender.close()
    from_worker = _captured(monkeypatch, tasks.advance, "apply_async")
    monkeypatch.setattr(tasks, "settings", settings)
    tasks.enqueue("m-1", 4, 0.0, "shop", name=telemetry.step_name("shop", telemetry.NEW_INPUT))

    (produced,), (worked,) = from_producer, from_worker
    assert produced["args"] == (step_message.ADVANCE,) and tasks.advance.name == step_message.ADVANCE
    assert produced["kwargs"] == worked["kwargs"] == {"session_id": "m-1", "seq": 4}
    assert produced["queue"] == worked["queue"] == settings.agent_queue("shop")
    assert produced["shadow"] == worked["shadow"] == "shop: new input"
    worker_options = lousho_celery.worker_options(settings)["broker_transport_options"]
    assert producer_options == worker_options == step_message.broker_options(settings)
    assert producer_options["visibility_timeout"] == settings.visibility_timeout_s


def test_a_worker_app_built_by_configure_shares_the_step_messages_broker_options() -> None:
    settings = services.test_settings()
    app = Celery("m", set_as_current=False)
    lousho_celery.configure(app, settings)
    assert step_message.ADVANCE in lousho_celery.TASKS
    options = app.conf.broker_transport_options
    assert {key: options[key] for key in step_message.broker_options(settings)} == step_message.broker_options(settings)


@pytest.mark.parametrize(("session_id", "seq"), [("run-1", 3), ("desk.task-0123456789abcdef", None), ("a_b-c.d", 0)])
def test_the_reprs_a_step_message_carries_are_the_ones_celery_would_make(session_id: str, seq: int | None) -> None:
    reprs = step_message.reprs(session_id, seq)
    assert reprs["kwargsrepr"] == saferepr(step_message.arguments(session_id, seq), 1024)
    assert reprs["argsrepr"] == saferepr((), 1024)
