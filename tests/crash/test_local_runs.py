"""``worker.testing.run_local`` runs an agent as real workers do: the same run (tools, an approval, a sub-agent, a
hook) on ``celery worker`` processes and in this process gives the same transcript, ids aside."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from store.records import Message
from tests.support.cluster import Cluster
from tests.support.local_agents import desk
from worker.testing import run_local

pytestmark = pytest.mark.crash

PROMPT = "What about Oslo? Charge me 5."


def _said(messages: list[Message]) -> list[tuple[Any, ...]]:
    """A transcript without its ids: role, text, calls (tool and arguments), tool names."""
    return [(m.role, m.content, [(c.name, c.args) for c in m.tool_calls or []], m.name) for m in messages]


def test_a_run_on_real_workers_and_the_same_run_in_process_give_the_same_transcript(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = make_cluster(extra_env={"LOUSHO_AGENTS": "tests.support.local_agents"})
    cluster.start_worker(concurrency=2)
    cluster.client.agent("desk").send(PROMPT, session_id="desk-1")
    cluster.wait_finished(["desk-1"], timeout=60, on_poll=lambda: cluster.approve_pending("desk"))
    real = cluster.checkpoint("desk", "desk-1")
    local = run_local(desk, PROMPT, session_id="desk-1", decide=lambda approval: True)
    print(
        f"\nreal workers: {real.finish_reason} in {real.step} steps; in process: {local.finish_reason} in {local.steps}"
    )
    assert local.finish_reason == real.finish_reason == "stop"
    assert _said(local.messages) == _said(real.messages)
    assert (local.steps, local.usage) == (real.step, real.usage)
