"""A real run exported (``Client.export``, ``lousho export``) and replayed through its agent with no service and no
socket (``worker.testing.replay``, ``lousho replay``): no divergence against the same agent, the second turn's step
against one whose second answer differs, and the exit status that gates a CI job."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from producer.client import Client
from store.recordings import Recording
from tests.support.cli_fixtures import Lousho
from tests.support.driver import Driver
from tests.support.local_agents import clerk, desk
from tests.support.local_agents_v2 import desk as desk_v2
from worker.testing import replay

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _real_run(make_driver: Callable[..., Driver], client: Client, session_id: str) -> Recording:
    driver = make_driver(desk, clerk)
    client.agent("desk").send("What about Oslo? Charge me 5.", session_id=session_id)
    driver.drain(session_id)
    [pending] = client.agent("desk").approvals.list()
    client.agent("desk").approvals.resolve(pending.approval_id, approved=True)
    driver.drain(session_id)
    checkpoint = client.agent("desk").load(session_id)
    assert checkpoint is not None and checkpoint.status == "finished" and checkpoint.finish_reason == "stop"
    return client.export(session_id)


def test_an_exported_real_run_replays_with_no_divergence_and_no_socket_and_a_changed_answer_is_named(
    make_driver: Callable[..., Driver], client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    recording = _real_run(make_driver, client, "rec-1")
    assert recording.agent == "desk" and len(recording.turns) == 2 and len(recording.children) == 1
    assert recording.children[0].agent == "clerk" and recording.children[0].text == "Filed."
    assert [(d.tool_name, d.status) for d in recording.decisions] == [("charge", "approved")]
    text = recording.model_dump_json()
    attempts: list[Any] = []

    def refuse(sock: socket.socket, address: Any) -> None:
        attempts.append(address)
        raise AssertionError(f"a socket was opened to {address}")

    with monkeypatch.context() as patched:
        patched.setattr(socket.socket, "connect", refuse)
        same = replay(text, desk)
        cassette = replay(text, desk, model="recorded")
        changed = replay(text, desk_v2)
    print(f"\n{same.describe()}\n{changed.describe()}\nsockets opened: {len(attempts)}")
    assert attempts == []
    assert not same.diverged and same.result.text == recording.text
    assert not cassette.diverged and cassette.requests == []
    assert changed.diverged_at == recording.turns[1].step


def test_lousho_export_and_replay_exit_0_when_the_turns_match_and_1_when_they_diverge(
    make_driver: Callable[..., Driver], client: Client, lousho: Lousho, tmp_path: Path
) -> None:
    _real_run(make_driver, client, "rec-2")
    exported = lousho("export", "rec-2", "--output", str(tmp_path / "rec-2.json"))
    assert exported.code == 0, exported.err
    recorded = json.loads((tmp_path / "rec-2.json").read_text())
    assert recorded["format"] == "lousho-recording/1" and recorded["session_id"] == "rec-2"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOUSHO_")}
    env["PYTHONPATH"] = str(ROOT)

    def lousho_replay(*extra: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "producer.cli", "replay", str(tmp_path / "rec-2.json"), *extra]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)

    matching = lousho_replay("--agents", "tests.support.local_agents")
    diverging = lousho_replay("--agents", "tests.support.local_agents_v2")
    print(f"\n{matching.stdout}\n{diverging.stdout}")
    assert matching.returncode == 0, matching.stderr[-2000:]
    assert matching.stdout.startswith("no divergence: 2 turn(s) as recorded")
    assert diverging.returncode == 1, diverging.stderr[-2000:]
    assert diverging.stdout.startswith(f"diverged at step {recorded['turns'][1]['step']}")
