"""One trace per run input across real ``celery worker`` processes (``worker.tracing``, ``LOUSHO_TRACING=1``).

Two workers with one pool process each: a step enqueues the next one before its message is acked, and a pool
process holds one unacked message at most (prefetch 1), so the next step goes to the other worker. Each pool
process collects its spans in the SDK's ``InMemorySpanExporter`` and moves them to a file of its own
(``tests.support.span_files``); the test reads the files and checks that the steps, wherever they ran, make one
trace under the run input's root span, whose ids the run's checkpoint keeps.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support import span_files
from tests.support.agents import run_input
from tests.support.cluster import AGENTS_MODULE, Cluster, fresh_id, wait_until
from worker.tracing import TraceContext

#: Three model turns with two tool calls between them: five steps.
TURNS = 3
STEPS = 2 * TURNS - 1


def _of_run(spans: list[dict[str, Any]], run_id: str, trace_id: str) -> list[dict[str, Any]]:
    """The run's spans: those in its trace (every span of a step is, its step says which run it is)."""
    return [s for s in spans if s["trace_id"] == trace_id or s["attributes"].get("lousho.session_id") == run_id]


def test_a_run_input_is_one_trace_across_two_worker_processes(
    make_cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    folder = tmp_path / "spans"
    folder.mkdir()
    cluster = make_cluster(
        extra_env={
            "LOUSHO_TRACING": "1",
            "LOUSHO_AGENTS": f"{AGENTS_MODULE},{span_files.MODULE}",
            span_files.SPANS_ENV: str(folder),
        }
    )
    workers = [cluster.start_worker("w1", concurrency=1), cluster.start_worker("w2", concurrency=1)]
    run_id = fresh_id("traced")

    cluster.send("chaos", run_id, run_input(run_id, turns=TURNS, calls="2", sleep="20-40", model=30))
    cluster.wait_finished([run_id], timeout=60)

    saved = TraceContext.parse(cluster.checkpoint("chaos", run_id).trace)
    assert saved is not None, "the run's checkpoint keeps no trace context"
    trace_id, root_id = f"{saved.trace_id:032x}", f"{saved.span_id:016x}"
    # The last step writes its spans (the root among them) just after its save.
    wait_until(lambda: any(s["span_id"] == root_id for s in span_files.read_spans(folder)), 10, "the root span")
    spans = _of_run(span_files.read_spans(folder), run_id, trace_id)
    roots = [s for s in spans if s["name"].startswith("invoke_agent ")]
    steps = [s for s in spans if s["name"].startswith("step ")]
    chats = [s for s in spans if s["name"].startswith("chat ")]
    tools = [s for s in spans if s["name"].startswith("execute_tool ")]
    pids = Counter(s["pid"] for s in steps)
    print(
        f"trace {trace_id}: {len(spans)} spans ({len(roots)} root, {len(steps)} steps, {len(chats)} model calls,"
        f" {len(tools)} tool calls); spans per pid {dict(Counter(s['pid'] for s in spans))};"
        f" steps per pid {dict(pids)}; steps in order {[(s['name'], s['pid']) for s in sorted(steps, key=_start)]}"
    )

    # One trace: every span of the run, whichever process made it.
    assert {s["trace_id"] for s in spans} == {trace_id}
    # Its root is the run input, with the ids the checkpoint saved, covering every step.
    [root] = roots
    assert root["span_id"] == root_id and root["parent_id"] is None and root["name"] == "invoke_agent chaos"
    assert root["attributes"]["lousho.ended_as"] == "finished"
    assert root["start"] <= min(_start(s) for s in steps) and root["end"] >= max(s["end"] for s in steps)
    # Each step is a span under the root, the model and tool calls under their step.
    assert len(steps) == STEPS and all(s["parent_id"] == root_id for s in steps)
    step_ids = {s["span_id"] for s in steps}
    assert all(c["parent_id"] in step_ids for c in chats + tools)
    kinds = Counter(s["attributes"]["lousho.kind"] for s in steps)
    assert kinds == {"model turn": TURNS, "tool batch": TURNS - 1}, kinds
    # The steps ran in two worker processes, one in each worker.
    assert len(pids) >= 2, f"every step ran in one process: {dict(pids)}"
    pools = [set(w.children()) for w in workers]
    assert all(pool & set(pids) for pool in pools), f"steps per pid {dict(pids)}, pool processes {pools}"
    # Model calls carry their token counts, tool calls their tool.
    assert len(chats) == TURNS
    assert all(
        c["attributes"]["gen_ai.usage.input_tokens"] > 0 and c["attributes"]["gen_ai.usage.output_tokens"] > 0
        for c in chats
    )
    assert len(tools) == 2 * (TURNS - 1)
    assert {t["attributes"]["gen_ai.tool.name"] for t in tools} == {"work"}
    assert all(t["attributes"]["gen_ai.operation.name"] == "execute_tool" for t in tools)


def _start(span: dict[str, Any]) -> int:
    return int(span["start"])
