"""Duplicate delivery: every step message published twice, the copy after a random jitter.

The workers load ``tests.support.agents`` with ``LOUSHO_TEST_DUPLICATE=0-500``, which republishes
each ``lousho.advance`` they send from a Celery ``after_task_publish`` hook; the test duplicates the
producer's first message itself. No product code changes for the test.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

from tests.support import checker
from tests.support.agents import DUPLICATE_ENV, run_input
from tests.support.cluster import Cluster

RUNS = 20


def test_every_message_delivered_twice_executes_nothing_twice(make_cluster: Callable[..., Cluster]) -> None:
    cluster = make_cluster(extra_env={DUPLICATE_ENV: "0-500"})
    cluster.start_worker(concurrency=2)
    cluster.start_beat()
    run_ids = [f"dup-{n:02d}" for n in range(RUNS)]
    timers = []
    for run_id in run_ids:
        cluster.send("chaos", run_id, run_input(run_id))
        timer = threading.Timer(random.uniform(0, 0.5), cluster.client.enqueuer.advance, (run_id,))
        timer.start()
        timers.append(timer)
    for timer in timers:
        timer.join()

    cluster.wait_finished(run_ids, timeout=60)
    report = checker.check(cluster.database_url, cluster.log_path, expected=run_ids)
    checker.print_report(report, "duplicate delivery (every message twice, 0-500 ms jitter)")
    outcomes = cluster.outcomes()
    duplicates = sum(1 for e in cluster.events() if e.get("kind") == "duplicate")
    print(
        f"duplicates published: {duplicates + RUNS}, stale_dropped: {outcomes['stale']},"
        f" busy_rejections: {outcomes['busy']}, idle: {outcomes['idle']},"
        f" double executions: {report['raw_reexecutions']}, wasted model calls: {report['wasted_model_calls']}"
    )
    checker.assert_clean(report)
    assert report["raw_reexecutions"] == 0
    assert report["wasted_model_calls"] == 0 and report["interrupted_model_calls"] == 0
    assert report["executions"] == RUNS * 5
    # Each run sends 4 step messages of its own; a vacuous run would drop no copy at all.
    assert duplicates >= RUNS * 3, f"only {duplicates} duplicates were published"
    assert outcomes["stale"] + outcomes["busy"] + outcomes["idle"] >= duplicates
