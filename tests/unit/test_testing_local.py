"""``worker.testing``: an agent's run on the real step machine in this process (``run_local``, ``lousho_local``),
and a recorded run replayed through an agent (``replay``), with no service."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from store import errors, faults, recordings
from store.records import Approval
from tests.support.local_agents import desk
from tests.support.local_agents_v2 import desk as desk_v2
from worker import Agent, tool
from worker.providers import MockModel
from worker.testing import LocalRuntime, replay, run_local
from worker.testing.fixtures import LocalRunner

ROOT = Path(__file__).resolve().parents[2]
#: Run in an interpreter with no Lousho setting and every connection beyond a Unix socket refused.
NO_SERVICES = textwrap.dedent(
    """
    import socket, sys
    def refuse(sock, address):
        raise AssertionError(f"a socket was opened to {address}")
    socket.socket.connect = refuse
    socket.create_connection = lambda *a, **k: refuse(None, a[0])
    from tests.support.local_agents import desk
    from worker.testing import run_local
    decided = []
    result = run_local(desk, "What about Oslo? Charge me 5.", session_id="desk-1",
                       decide=lambda approval: decided.append(approval.tool_name) or True)
    print(result.finish_reason, "|", result.text, "|", decided, "|", [m.role for m in result.messages])
    """
)


def _record(runtime: LocalRuntime, session_id: str) -> recordings.Recording:
    events = list(runtime.events(session_id))
    checkpoint = runtime.checkpoint(session_id)
    approvals = runtime.approvals.by_ids(recordings.approval_ids(events)).values()
    return recordings.build(
        session_id, checkpoint.agent, events, checkpoint.messages, approvals, fingerprint=checkpoint.fingerprint
    )


def test_run_local_runs_tools_a_decided_approval_a_sub_agent_and_a_hook_with_no_setting_and_no_socket() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOUSHO_")}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-c", NO_SERVICES], env=env, capture_output=True, text=True, timeout=60)
    print(f"\n{done.stdout.strip()}")
    assert done.returncode == 0, done.stderr[-2000:]
    finish, text, decided, roles = (part.strip() for part in done.stdout.strip().split("|"))
    assert (finish, text, decided) == ("stop", "Sunny in Oslo; charged 5 and filed.", "['charge']")
    assert roles == "['system', 'user', 'assistant', 'tool', 'tool', 'tool', 'assistant']"


def test_without_decide_a_paused_run_comes_back_paused_and_a_later_decision_finishes_it() -> None:
    runtime = LocalRuntime.serving([desk])
    paused = run_local(desk, "Charge me 5.", session_id="desk-2", runtime=runtime)
    assert paused.finish_reason == "awaiting-approval" and len(paused.approval_ids) == 1
    [pending] = runtime.approvals.pending()
    assert pending.tool_name == "charge" and pending.args == {"amount": 5}
    finished = runtime.settle("desk-2", decide=lambda a: False)
    assert finished.finish_reason == "stop"
    [charged] = [m for m in finished.messages if m.role == "tool" and m.name == "charge"]
    assert "rejected" in str(charged.content).lower()


def test_a_crash_point_stops_a_step_as_a_dead_process_would_and_the_run_recovers() -> None:
    ran: list[str] = []

    @tool
    def ship(order: str) -> str:
        """Ship an order."""
        ran.append(order)
        return f"shipped {order}"

    shop = Agent(
        name="shop",
        model=MockModel([{"tool_calls": [{"name": "ship", "args": {"order": "a1"}}]}, "done"]),
        tools=[ship],
    )
    runtime = LocalRuntime.serving([shop])
    result = run_local(shop, "ship a1", runtime=runtime, crash_at="after_tool_effect_before_result_save")
    # The tool's effect happened, its result was not saved: on recovery the call runs again (a plain tool).
    assert result.finish_reason == "stop" and ran == ["a1", "a1"]
    assert [crash.point for crash in runtime.crashes] == ["after_tool_effect_before_result_save"]
    with pytest.raises(errors.ConfigurationError, match="unknown crash point"):
        run_local(shop, "x", crash_at="no_such_point")


def test_the_lousho_local_fixture_runs_an_agent_and_keeps_its_events(lousho_local: LocalRunner) -> None:
    result = lousho_local.run(desk, "What about Oslo? Charge me 5.", decide=lambda approval: True)
    assert result.finish_reason == "stop"
    types = [event.type for event in lousho_local.events()]
    assert types[0] == "run.start" and types[-1] == "run.done" and "subagent.start" in types


def test_a_replay_through_the_same_agent_matches_and_one_whose_second_turn_differs_names_that_step() -> None:
    runtime = LocalRuntime.serving([desk])
    run_local(desk, "What about Oslo? Charge me 5.", session_id="desk-3", runtime=runtime, decide=lambda a: True)
    recording = _record(runtime, "desk-3")
    assert sorted(r.name for r in recording.results) == ["charge", "lookup", "task"]
    assert [d.status for d in recording.decisions] == ["approved"] and len(recording.turns) == 2
    same = replay(recording.model_dump_json(), desk)
    cassette = replay(json.loads(recording.model_dump_json()), desk, model="recorded")
    changed = replay(recording, desk_v2)
    print(f"\n{same.describe()}\n{changed.describe()}")
    assert not same.diverged and same.result.text == recording.text and same.unrecorded_calls == []
    assert not cassette.diverged and cassette.requests == []
    assert changed.diverged_at == recording.turns[1].step
    assert [d.same for d in changed.turns] == [False]
    assert changed.turns[0].replayed == {"text": "It rains in Oslo.", "calls": []}


def test_a_replay_with_the_recorded_model_names_a_changed_instruction_and_tool_schema() -> None:
    runtime = LocalRuntime.serving([desk])
    run_local(desk, "What about Oslo? Charge me 5.", session_id="desk-4", runtime=runtime, decide=lambda a: True)
    recording = _record(runtime, "desk-4")

    @tool(needs_approval=True)
    def charge(amount: int, currency: str = "EUR") -> str:
        """Charge the customer."""
        return f"charged {amount} {currency}"

    changed = desk.replace(instructions="You run the desk.", tools=[desk.tools["lookup"], charge])
    report = replay(recording, changed, model="recorded")
    assert report.diverged_at == recording.turns[0].step
    assert report.requests == ["the instructions changed", "tool charge: schema"]


def test_a_recording_of_another_agent_or_no_recording_is_refused() -> None:
    with pytest.raises(errors.ConfigurationError, match="not a recording"):
        replay("{}", desk)
    other = recordings.Recording(session_id="x", agent="other", inputs=[], turns=[], results=[], decisions=[])
    with pytest.raises(errors.ConfigurationError, match="agent 'other'"):
        replay(other, desk)


def test_decide_receives_each_approval_of_the_run_and_its_children() -> None:
    seen: list[Approval] = []

    def decide(approval: Approval) -> bool:
        seen.append(approval)
        return True

    run_local(desk, "Charge me 5.", session_id="desk-5", decide=decide)
    assert [(a.tool_name, a.session_id) for a in seen] == [("charge", "desk-5")]


def test_the_named_crash_points_are_every_point_a_step_passes() -> None:
    found: set[str] = set()
    for path in [*(ROOT / "worker").rglob("*.py"), ROOT / "producer" / "client.py"]:
        for call in re.findall(r"crash_point\((.*?)\)", path.read_text(), re.S):
            found |= set(re.findall(r'"([a-z_]+)"', call))
    assert found - {"tick_claim_before_publish"} == faults.POINTS


def test_a_once_tool_interrupted_after_its_effect_is_reconciled_not_run_again() -> None:
    charged: list[int] = []

    def already(args: dict[str, int], ctx: object) -> str | None:
        return f"charged {args['amount']} (found)" if args["amount"] in charged else None

    @tool(once=True, reconcile=already)
    def pay(amount: int) -> str:
        """Charge once."""
        charged.append(amount)
        return f"charged {amount}"

    model = MockModel([{"tool_calls": [{"name": "pay", "args": {"amount": 9}}]}, "paid"])
    till = Agent(name="till", model=model, tools=[pay])
    runtime = LocalRuntime.serving([till])
    result = run_local(till, "pay 9", runtime=runtime, crash_at="after_once_effect_before_result_save")
    [paid] = [m for m in result.messages if m.role == "tool"]
    assert result.finish_reason == "stop" and charged == [9] and paid.content == "charged 9 (found)"
    assert [crash.point for crash in runtime.crashes] == ["after_once_effect_before_result_save"]
