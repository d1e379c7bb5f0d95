"""Lousho in a team's own Celery app: ``install(app)`` keeps the app's settings, and one real ``celery worker`` of
that app runs a Lousho run to the end and the app's own task on the app's queue, through the app's backend."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
from celery import Celery

from tests.support import services
from tests.support.agents import run_input
from tests.support.cluster import Cluster


@pytest.mark.parametrize("lousho_broker", [True, False], ids=["LOUSHO_BROKER_URL-set", "LOUSHO_BROKER_URL-unset"])
def test_a_worker_of_the_team_s_app_runs_a_lousho_run_and_the_app_s_own_task(
    make_cluster: Callable[..., Cluster], lousho_broker: bool
) -> None:
    url = services.test_redis_url()
    env = {"HOST_APP_REDIS_URL": url, **({"LOUSHO_BROKER_URL": url} if lousho_broker else {})}
    cluster = make_cluster(extra_env=env)
    worker = cluster.start_worker(app="tests.support.host_app", concurrency=2)
    caller = Celery("caller", broker=url, backend=url, set_as_current=False)
    caller.conf.update(task_routes={"billing.*": {"queue": "billing"}})

    cluster.send("chaos", "hosted-1", run_input("hosted-1", calls="2"))
    invoiced = caller.send_task("billing.invoice", args=("order-7",))

    cluster.wait_finished(["hosted-1"], timeout=60)
    assert invoiced.get(timeout=30) == "invoiced order-7"
    log = worker.log_path.read_text(errors="replace")
    assert "Task billing.invoice[" in log and "succeeded" in log
    consumed = set(re.findall(r"\.> (\S+)\s+exchange=", log))
    assert consumed >= {"billing", "billing-slow", "lousho", "lousho-control", "lousho-start", "lousho.chaos"}
    caller.close()
