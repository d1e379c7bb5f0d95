"""The broker redelivers a step that is still running (RELIABILITY C3): the lease turns the copy away.

Workers run with a 4-second visibility timeout (``tests.support.short_visibility``) and tools that sleep 7 s, so
kombu restores each unacked tool-batch message while its step still works. The copy must be dropped (the run's
lease is held) and no call may run twice.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable

import pytest

from tests.support import checker
from tests.support.agents import run_input
from tests.support.cluster import AGENTS_MODULE, Cluster
from tests.support.short_visibility import ENV as VISIBILITY_ENV

pytestmark = pytest.mark.crash

_RECEIVED = re.compile(r"Task [^\[]+\[([0-9a-f-]+)\] received")


def test_a_step_redelivered_while_it_runs_is_dropped_and_runs_nothing_twice(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = make_cluster(
        extra_env={"LOUSHO_AGENTS": f"{AGENTS_MODULE},tests.support.short_visibility", VISIBILITY_ENV: "4"}
    )
    cluster.start_worker("w1", concurrency=2)
    cluster.start_worker("w2", concurrency=2)
    runs = [f"redeliver-{n}" for n in range(5)]
    for run_id in runs:
        cluster.send("chaos", run_id, run_input(run_id, turns=2, calls="1", sleep="7000-7000", model=10))
    cluster.wait_finished(runs, timeout=90)
    received = Counter(_RECEIVED.findall(cluster.worker_logs()))
    redelivered = {task: count for task, count in received.items() if count > 1}
    report = checker.check(cluster.database_url, cluster.log_path, expected=runs, faults=cluster.faults)
    checker.print_report(report, "visibility timeout 4 s, tools of 7 s")
    executions = Counter(
        str(e["tool_call_id"]) for e in cluster.events() if e.get("kind") == "tool" and e.get("phase") == "start"
    )
    doubled = {call: n for call, n in executions.items() if n > 1}
    outcomes = cluster.outcomes()
    print(
        f"C3: {len(redelivered)} step message(s) redelivered while running ({sum(redelivered.values())} deliveries),"
        f" busy drops {outcomes['busy']}, tool calls {len(executions)}, run twice {len(doubled)}"
    )
    checker.assert_clean(report)
    assert redelivered, "no message was redelivered: the test saw nothing (vacuous)"
    assert outcomes["busy"] >= 1
    assert not doubled, doubled
