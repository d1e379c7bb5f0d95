"""A real worker's log, as an operator reads it: steps named for what they are, JSON lines with the run's fields."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from tests.support.agents import run_input
from tests.support.cluster import Cluster

pytestmark = pytest.mark.crash


def _json_lines(text: str) -> list[dict[str, Any]]:
    lines = []
    for raw in text.splitlines():
        if raw.startswith("{"):
            lines.append(json.loads(raw))
    return lines


def test_a_worker_with_json_logs_names_each_step_and_tags_its_lines_with_the_run(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = make_cluster(extra_env={"LOUSHO_LOG_FORMAT": "json"})
    cluster.start_worker("w1", concurrency=2)
    run_id = f"json-logs-{uuid.uuid4().hex[:8]}"
    text = run_input(run_id, turns=2, calls="2", sleep="5-10", model=5)
    cluster.send("chaos", run_id, text)
    cluster.wait_finished([run_id], timeout=60)
    log = cluster.worker_logs()
    lines = _json_lines(log)
    assert lines, "no JSON log lines"
    ours = [line for line in lines if line.get("session_id") == run_id]
    # Every line a step writes carries the run, its agent, the message's seq, the step number and the task id.
    outcomes = [line for line in ours if line["message"].startswith(f"advance {run_id}")]
    assert len(outcomes) >= 3, ours
    for line in outcomes:
        assert line["agent"] == "chaos" and isinstance(line.get("seq"), int | None) and line["task_id"]
        assert isinstance(line["step"], int)
    # Celery's own lines about the step task: named for the agent and the kind, the result says what it did.
    done = [line["message"] for line in lines if " succeeded in " in line["message"]]
    # The producer names the first step for why it sent it (new input); workers name the rest for what they do.
    assert any(message.startswith("Task chaos: new input[") for message in done), done
    model_turns = [
        message for message in done if message.startswith(("Task chaos: model turn[", "Task chaos: new input["))
    ]
    batches = [message for message in done if message.startswith("Task chaos: tool batch[")]
    print("\n".join(done))
    assert any("'model turn: 2 tool calls'" in message for message in model_turns), done
    assert any("'tool batch: 2 results'" in message for message in batches), done
    assert any("finished: stop'" in message for message in model_turns), done
    # No content: neither the input nor the tools' sleeps appear in the log.
    assert "turns=2" not in log and "sleep=5-10" not in log
