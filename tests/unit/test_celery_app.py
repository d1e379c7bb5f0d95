"""The Celery app: Lousho's own (``create_app``), and ``install`` into a team's app, which keeps what the app had."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from celery.schedules import crontab
from kombu import Queue  # type: ignore[attr-defined]  # kombu does not list Queue in __all__

from store import errors
from store.settings import Settings
from tests.support import services
from worker import celery as lousho_celery

HOST_BROKER = services.redis_url_with_db(5)
#: What the team's app sets itself (``_host_app``).
HOST_SETTINGS = {
    "broker_url": HOST_BROKER,
    "result_backend": services.redis_url_with_db(6),
    "task_default_queue": "billing",
    "task_queues": [Queue("billing"), Queue("billing-slow")],  # type: ignore[no-untyped-call]  # kombu is untyped
    "task_routes": {"billing.slow_*": {"queue": "billing-slow"}},
    "beat_schedule": {"invoices": {"task": "billing.invoices", "schedule": crontab(minute=0, hour=6)}},
    "timezone": "Europe/Paris",
    "enable_utc": False,
    "task_time_limit": 900,
    "task_soft_time_limit": 600,
    "task_serializer": "json",
    "accept_content": ["json", "msgpack"],
    "worker_prefetch_multiplier": 4,
    "task_acks_late": False,
    "include": ["billing.tasks"],
}


@pytest.fixture(autouse=True)
def _restore_current_app() -> Iterator[None]:
    """A new Celery app becomes the current one; later tests send through the worker's app."""
    yield
    lousho_celery.app.set_current()


def _host_app() -> Celery:
    """A team's app with its own broker, backend, routes, queues, beat entries, default queue, zone and limits."""
    host = Celery("billing", set_as_current=False)
    host.conf.update(HOST_SETTINGS)
    return host


def _own_settings(host: Celery) -> dict[str, Any]:
    """Every setting the app set itself, as it reads now."""
    return {key: host.conf[key] for key in HOST_SETTINGS}


@pytest.mark.parametrize("broker_url", [HOST_BROKER, None], ids=["LOUSHO_BROKER_URL-same", "LOUSHO_BROKER_URL-unset"])
def test_install_keeps_every_setting_of_the_app_and_adds_the_tasks_queues_and_sweeps(
    broker_url: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = _host_app()
    before = _own_settings(host)
    monkeypatch.setattr(lousho_celery, "settings", Settings(broker_url=broker_url))  # this process's settings

    lousho_celery.install(host)
    import worker.tasks  # noqa: F401 - registers the shared tasks, as the include does in a worker

    after = _own_settings(host)
    grown = {"task_queues", "beat_schedule", "include"}
    assert {key: value for key, value in after.items() if key not in grown} == {
        key: value for key, value in before.items() if key not in grown
    }
    assert host.conf.task_queues[:2] == before["task_queues"]
    assert [queue.name for queue in host.conf.task_queues[2:]] == ["lousho", "lousho-control", "lousho-start"]
    assert host.conf.beat_schedule["invoices"] == before["beat_schedule"]["invoices"]
    assert {"lousho-recover", "lousho-schedules"} <= set(host.conf.beat_schedule)
    assert host.conf.include == ["billing.tasks", "worker.tasks"]
    assert {"lousho.advance", "lousho.recover", "lousho.schedules", "lousho.prune", "lousho.start"} <= set(host.tasks)
    # What a task can carry is on Lousho's tasks, not on the app.
    start = host.tasks["lousho.start"]
    assert (start.serializer, start.acks_late, start.reject_on_worker_lost) == ("json", True, True)
    assert start.time_limit == lousho_celery.settings.step_time_limit_s and start.queue == "lousho-start"
    assert host.tasks["lousho.recover"].queue == "lousho-control"
    assert host.conf.beat_schedule["lousho-recover"]["options"]["queue"] == "lousho-control"


def test_an_app_without_queues_keeps_consuming_its_default_queue() -> None:
    host = Celery("plain", set_as_current=False)
    host.conf.update(broker_url=HOST_BROKER, task_default_queue="plain")

    lousho_celery.install(host, Settings())

    assert set(host.amqp.queues.consume_from) == {"plain", "lousho", "lousho-control", "lousho-start"}


def test_an_app_without_a_broker_gets_lousho_s() -> None:
    from worker import install

    host = Celery("nobroker", set_as_current=False)

    install(host, Settings(redis_url=services.redis_url_with_db(3)))

    assert host.conf.broker_url == services.redis_url_with_db(3)


def test_install_refuses_a_broker_other_than_lousho_broker_url() -> None:
    host = _host_app()

    with pytest.raises(errors.ConfigurationError, match="broker_url is not LOUSHO_BROKER_URL") as raised:
        lousho_celery.install(host, Settings(broker_url=services.redis_url_with_db(9)))

    assert raised.value.variable == "LOUSHO_BROKER_URL"
    assert host.conf.include == ["billing.tasks"]  # nothing added


def test_install_refuses_a_visibility_timeout_shorter_than_a_step() -> None:
    host = _host_app()
    host.conf.broker_transport_options = {"visibility_timeout": 60}

    with pytest.raises(errors.ConfigurationError, match="visibility_timeout") as raised:
        lousho_celery.install(host, Settings(broker_url=HOST_BROKER))

    assert raised.value.field == "broker_transport_options"
    assert host.conf.task_queues == HOST_SETTINGS["task_queues"] and host.conf.include == ["billing.tasks"]


def _worker(app: Celery, queues: list[str] | None = None) -> Any:
    """What the worker hook reads of a starting worker: its app (finalized), its consumed queues, its prefetch."""
    import worker.tasks  # noqa: F401 - registers the shared tasks, as the include does in a worker

    app.finalize()
    if queues is not None:
        app.amqp.queues.select(queues)
    return SimpleNamespace(app=app, prefetch_multiplier=app.conf.worker_prefetch_multiplier)


def test_a_worker_that_consumes_lousho_s_queues_gets_the_worker_settings_at_start() -> None:
    host = lousho_celery.install(_host_app(), Settings(broker_url=HOST_BROKER))
    worker = _worker(host)

    lousho_celery._prepare_worker(sender=worker)

    assert worker.prefetch_multiplier == 1 == host.conf.worker_prefetch_multiplier
    assert host.conf.accept_content == ["json"]
    assert host.conf.broker_transport_options["visibility_timeout"] == lousho_celery.settings.visibility_timeout_s
    assert host.conf.worker_cancel_long_running_tasks_on_connection_loss is True
    lousho_celery.check_configuration(host)


def test_a_worker_of_the_app_s_own_queues_only_is_left_as_it_is() -> None:
    host = lousho_celery.install(_host_app(), Settings(broker_url=HOST_BROKER))
    worker = _worker(host, ["billing"])

    lousho_celery._prepare_worker(sender=worker)

    assert not lousho_celery.serves_lousho(worker)
    assert worker.prefetch_multiplier == 4 == host.conf.worker_prefetch_multiplier
    assert host.conf.accept_content == ["json", "msgpack"]


def test_create_app_builds_a_new_app_without_touching_the_module_app() -> None:
    built = lousho_celery.create_app()

    assert built is not lousho_celery.app
    assert built.main == "lousho"
    assert built.conf.task_default_queue == lousho_celery.app.conf.task_default_queue == lousho_celery.settings.queue
    lousho_celery.check_configuration(built)


def test_an_unsafe_configuration_is_refused() -> None:
    mine = lousho_celery.create_app()
    mine.conf.accept_content = ["json", "pickle"]

    with pytest.raises(errors.ConfigurationError, match="only JSON"):
        lousho_celery.check_configuration(mine)


def test_beat_modules_give_their_entries_in_order_and_refuse_what_cannot_be_read() -> None:
    entries = lousho_celery.beat_module_entries(Settings(beat_modules="tests.support.start_agents"))
    assert set(entries) == {"ticks", "plain"} and entries["ticks"]["task"] == "lousho.start"

    for modules, problem in [
        ("tests.support.nowhere", "cannot be imported"),
        ("tests.support", "no beat_schedule"),
        ("tests.support.start_agents,tests.support.start_agents", "defined twice"),
    ]:
        with pytest.raises(errors.ConfigurationError, match=problem) as raised:
            lousho_celery.beat_module_entries(Settings(beat_modules=modules))
        assert raised.value.variable == "LOUSHO_BEAT_MODULES"


def test_a_beat_whose_beat_modules_cannot_be_read_stops() -> None:
    host = lousho_celery.install(_host_app(), Settings(broker_url=HOST_BROKER, beat_modules="tests.support.nowhere"))

    with pytest.raises(SystemExit):
        lousho_celery._prepare_beat(sender=SimpleNamespace(app=host))
