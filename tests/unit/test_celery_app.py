"""The Celery app is built by a function that sets up an application's own app the same way."""

from __future__ import annotations

import pytest
from celery import Celery

from worker import celery as lousho_celery


@pytest.fixture(autouse=True)
def _restore_current_app() -> object:
    """A new Celery app becomes the current one; later tests send through the worker's app."""
    yield
    lousho_celery.app.set_current()


def test_install_gives_an_existing_app_the_configuration_the_sweeps_and_the_tasks() -> None:
    mine = Celery("mine")
    mine.conf.include = ["myapp.tasks"]

    lousho_celery.install(mine)
    import worker.tasks  # noqa: F401 - registers the shared tasks, as the include does in a worker

    assert mine.conf.accept_content == ["json"]
    assert mine.conf.task_acks_late and mine.conf.task_reject_on_worker_lost
    assert mine.conf.task_default_queue == lousho_celery.settings.queue
    assert set(mine.conf.beat_schedule) == {"lousho-recover", "lousho-schedules"}
    assert mine.conf.include == ["myapp.tasks", "worker.tasks"]
    assert {"lousho.advance", "lousho.recover", "lousho.schedules", "lousho.start"} <= set(mine.tasks)
    start_queue = f"{lousho_celery.settings.queue}-start"
    assert start_queue in {queue.name for queue in mine.conf.task_queues}
    assert mine.conf.task_routes["lousho.start"] == {"queue": start_queue}


def test_create_app_builds_a_new_app_without_touching_the_module_app() -> None:
    built = lousho_celery.create_app()

    assert built is not lousho_celery.app
    assert built.main == "lousho"
    assert built.conf.task_default_queue == lousho_celery.app.conf.task_default_queue == lousho_celery.settings.queue


def test_an_unsafe_configuration_is_refused() -> None:
    mine = lousho_celery.install(Celery("mine"))
    mine.conf.accept_content = ["json", "pickle"]

    with pytest.raises(RuntimeError, match="only JSON"):
        lousho_celery.check_configuration(mine)
