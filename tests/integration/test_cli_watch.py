"""``lousho watch``, ``abort`` and ``steer`` on real runs stepped in this process.

The interrupted watch is a real ``python -m producer.cli watch`` process stopped with SIGINT; the watch that
continues it runs in this process and must print nothing the first one printed.
"""

from __future__ import annotations

import io
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import redis

from producer.cli import output
from producer.client import Client
from store import keys
from store.events import Event
from tests.support import services
from tests.support.cli_fixtures import Lousho, drive_in_background
from tests.support.driver import Driver
from worker import Agent, PropagatingToolError, tool
from worker.providers import MockModel

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Watch positions go to a directory of the test."""
    directory = tmp_path / "watch"
    monkeypatch.setenv("LOUSHO_WATCH_STATE_DIR", str(directory))
    return directory


def _once_watched(redis_client: redis.Redis, session_id: str) -> Callable[[], bool]:
    """Whether a consumer marked the run watched (from then on its steps publish live signals)."""
    return lambda: bool(redis_client.exists(keys.watch_key(session_id)))


def test_watch_prints_each_tool_call_with_its_duration_and_the_result(
    lousho: Lousho, weather: Driver, client: Client, state_dir: Path, redis_client: redis.Redis
) -> None:
    client.agent("weather").send("Weather in Oslo?", session_id="w-1")
    thread = drive_in_background(weather, "w-1", _once_watched(redis_client, "w-1"))

    printed = lousho("watch", "w-1")
    thread.join(30)

    print(f"\n{printed.out}")
    assert printed.code == 0, printed.err
    lines = printed.out.splitlines()
    assert lines[0] == "-- input 1 (agent weather)"
    assert 'tool lookup({"city": "Oslo"}) ...' in lines  # tool.start, live
    [done] = [line for line in lines if line.startswith('tool lookup({"city": "Oslo"}) done')]
    assert done.endswith(": sunny in Oslo") and " ms: " in done
    assert any(line.startswith("== stop after 2 step(s); tokens ") for line in lines)
    assert lines.count("Sunny in Oslo.") == 1  # streamed, and not repeated by step.done or run.done
    assert not (state_dir / "w-1.json").exists()  # a watch that saw the run settle forgets its position


@pytest.mark.parametrize("live", [True, False])
def test_watch_json_interleaves_live_signals_only_when_live(
    lousho: Lousho, weather: Driver, client: Client, redis_client: redis.Redis, live: bool
) -> None:
    client.agent("weather").send("Weather in Oslo?", session_id="w-1")
    thread = drive_in_background(weather, "w-1", _once_watched(redis_client, "w-1"))

    printed = lousho("watch", "w-1", "--json", "--live" if live else "--no-live")
    thread.join(30)

    assert printed.code == 0, printed.err
    events = [json.loads(line) for line in printed.out.splitlines()]
    durable = [e for e in events if e["seq"] is not None]
    signals = {e["type"] for e in events if e["seq"] is None}
    print(f"\nlive={live}: {len(durable)} durable events, live signals {sorted(signals)}")
    assert [e["seq"] for e in durable] == list(range(len(durable)))
    assert [e["type"] for e in durable] == ["run.start", "step.done", "tool.done", "step.done", "run.done"]
    assert signals == ({"step.start", "tool.start", "text.delta"} if live else set())
    if live:
        deltas = "".join(e["data"]["text"] for e in events if e["type"] == "text.delta")
        assert deltas == "Sunny in Oslo."


def test_the_printer_shows_streamed_text_once_and_each_kind_of_event_on_its_line() -> None:
    out = io.StringIO()
    printer = output.EventPrinter(out)
    at = datetime.now(UTC)

    def show(event_type: str, seq: int | None = None, **data: Any) -> None:
        printer.show(Event(run_id="r-1", seq=seq, type=event_type, at=at, data=data))

    show("run.start", 0, agent="shop", input_number=1, resumed=False)
    show("step.start", step=1)
    show("text.delta", text="Let me ")
    show("text.delta", text="check.")
    show(
        "step.done",
        1,
        step=1,
        text="Let me check.",
        tool_calls=[
            {"id": "c1", "name": "charge", "args": {"amount": 5}},
            {"id": "c2", "name": "refund", "args": {"n": 1}},
        ],
    )
    show("tool.start", tool_call_id="c1", tool_name="charge", args={"amount": 5})
    show("tool.done", 2, tool_call_id="c1", tool_name="charge", result="ok\nmore", duration_ms=1234.5)
    show("tool.error", 3, tool_call_id="c2", tool_name="refund", result="boom", kind="cancelled", duration_ms=None)
    show("approval.requested", 4, approval_id="ap-1", tool_call_id="c3", tool_name="email", args={}, kind="tool")
    show("provider.retry", 5, code="LOUSHO_PROVIDER_RATE_LIMITED", message="slow down", failures=2, delay_s=1.5)
    show("error", 6, code="LOUSHO_X", message="bad", retryable=False)
    show(
        "run.done",
        7,
        finish_reason="awaiting-approval",
        text="Let me check.",
        steps=1,
        usage={"input_tokens": 3, "output_tokens": 4, "total_tokens": 7},
        approval_ids=["ap-1"],
    )
    show("compaction.done", 8, trigger="size")

    assert out.getvalue().splitlines() == [
        "-- input 1 (agent shop)",
        "Let me check.",
        'tool charge({"amount": 5}) ...',
        'tool charge({"amount": 5}) done in 1234 ms: ok more',
        'tool refund({"n": 1}) failed (cancelled): boom',
        "approval ap-1 needed for email({})",
        "  decide with: lousho approvals approve ap-1  (or: lousho approvals reject ap-1)",
        "provider failed (LOUSHO_PROVIDER_RATE_LIMITED, failure 2): slow down; next attempt in 1.5 s",
        "error LOUSHO_X: bad",
        "== awaiting-approval after 1 step(s); tokens 3 in, 4 out, 7 total",
        "waiting on approval ap-1",
        'compaction.done: {"trigger": "size"}',
    ]


def test_the_printer_says_what_a_reconciliation_found_and_how_to_decide_one() -> None:
    out = io.StringIO()
    printer = output.EventPrinter(out)
    at = datetime.now(UTC)

    def show(event_type: str, seq: int | None = None, **data: Any) -> None:
        printer.show(Event(run_id="r-1", seq=seq, type=event_type, at=at, data=data))

    show("step.done", 1, step=1, text=None, tool_calls=[{"id": "c1", "name": "charge", "args": {"order": "7"}}])
    show("tool.reconcile", 2, tool_call_id="c1", tool_name="charge", outcome="happened", by="reconcile", attempt=2)
    show("tool.reconcile", 3, tool_call_id="c1", tool_name="charge", outcome="asked", by="reconcile", attempt=2)
    show(
        "approval.requested",
        3,
        approval_id="ap-2",
        tool_call_id="c1",
        tool_name="charge",
        args={"order": "7"},
        kind="reconcile",
        question="Did it take effect?",
    )

    assert out.getvalue().splitlines() == [
        'tool charge({"order": "7"}) was interrupted by a crash: it took effect (found by reconcile, attempt 2)',
        'tool charge({"order": "7"}) was interrupted by a crash: a person decides (found by reconcile, attempt 2)',
        'reconciliation ap-2 needed for charge({"order": "7"}): Did it take effect?',
        "  decide with: lousho approvals answer ap-2 RESULT  (it took effect), approve ap-2  (run it again) or"
        " reject ap-2  (not done)",
    ]


def test_the_printer_prints_the_whole_text_of_a_step_it_saw_only_part_of() -> None:
    out = io.StringIO()
    printer = output.EventPrinter(out)
    at = datetime.now(UTC)

    printer.show(Event(run_id="r-1", seq=None, type="text.delta", at=at, data={"text": "check."}))
    printer.show(Event(run_id="r-1", seq=4, type="step.done", at=at, data={"step": 2, "text": "Let me check."}))

    assert out.getvalue() == "check.\nLet me check.\n"


def test_watch_json_prints_one_event_per_line_from_the_latest_input(
    lousho: Lousho, weather: Driver, client: Client
) -> None:
    agent = client.agent("weather")
    agent.send("Weather in Oslo?", session_id="w-1")
    weather.drain("w-1")
    agent.send("And now?", session_id="w-1")
    weather.drain("w-1")

    printed = lousho("watch", "w-1", "--json")
    after = lousho("watch", "w-1", "--json", "--after", "1")

    assert printed.code == 0, printed.err
    events = [json.loads(line) for line in printed.out.splitlines()]
    assert [e["type"] for e in events] == ["run.start", "step.done", "run.done"]
    assert events[0]["data"]["input_number"] == 2 and events[-1]["data"]["text"] == "Still sunny."
    assert {"run_id", "seq", "type", "at", "v", "data"} == events[0].keys()
    assert [e["seq"] for e in events] == list(range(events[0]["seq"], events[0]["seq"] + 3))
    # --after 1: the first input's events after seq 1, up to its run.done
    assert [json.loads(line)["seq"] for line in after.out.splitlines()] == [2, 3, 4]


@dataclass
class Watcher:
    """A ``lousho watch`` process and the lines of its stdout as they come."""

    process: subprocess.Popen[str]
    lines: queue.Queue[str]


@pytest.fixture
def watcher(state_dir: Path) -> Iterator[Watcher]:
    """``lousho watch w-1`` in a process of its own (so SIGINT reaches it as a terminal's Ctrl-C would)."""
    env = {**os.environ, **services.test_environment(), "LOUSHO_WATCH_STATE_DIR": str(state_dir)}
    process = subprocess.Popen(
        [sys.executable, "-m", "producer.cli", "watch", "w-1"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    yield Watcher(process, lines)
    if process.poll() is None:
        process.kill()
    process.wait(10)
    reader.join(10)
    for pipe in (process.stdout, process.stderr):
        if pipe is not None:
            pipe.close()


def test_a_watch_stopped_with_ctrl_c_continues_where_it_stopped_without_repeating(
    lousho: Lousho, weather: Driver, client: Client, state_dir: Path, watcher: Watcher
) -> None:
    # Given a run whose first model turn and tool batch are saved, and a watch that printed them
    client.agent("weather").send("Weather in Oslo?", session_id="w-1")
    weather.step("w-1")
    weather.step()
    process = watcher.process
    first: list[str] = []
    deadline = time.monotonic() + 30
    while not any(line.startswith("tool lookup(") for line in first):
        assert time.monotonic() < deadline, f"the watch printed only {first}"
        try:
            first.append(watcher.lines.get(timeout=0.5))
        except queue.Empty:
            assert process.poll() is None, process.stderr.read() if process.stderr else ""

    # When it is stopped with Ctrl-C, and run again once the run finished
    process.send_signal(signal.SIGINT)
    code = process.wait(30)
    err = process.stderr.read() if process.stderr else ""
    saved = json.loads((state_dir / "w-1.json").read_text())
    weather.drain()
    second = lousho("watch", "w-1")

    # Then the second watch printed only what the first had not, and the result
    print(f"\nfirst watch:\n{''.join(first)}{err}second watch:\n{second.out}")
    last_seen = max(e.seq or 0 for e in client.read_events("w-1", -1) if e.type == "tool.done")
    assert code == 130
    assert err.strip().endswith(f'stopped at seq {last_seen}; run "lousho watch w-1" to continue')
    assert saved["seq"] == last_seen
    assert second.code == 0, second.err
    assert not set(second.out.splitlines()) & {line.rstrip("\n") for line in first}
    assert second.out.splitlines()[0] == "Sunny in Oslo."
    assert second.out.splitlines()[1].startswith("== stop after 2 step(s)")
    assert not any(line.startswith(("tool ", "-- ")) for line in second.out.splitlines())


def test_a_saved_position_the_run_no_longer_has_is_dropped(
    lousho: Lousho, weather: Driver, client: Client, state_dir: Path
) -> None:
    client.agent("weather").send("Weather in Oslo?", session_id="w-1")
    weather.drain("w-1")
    state_dir.mkdir(parents=True)
    (state_dir / "w-1.json").write_text(json.dumps({"seq": 40, "at": "2020-01-01T00:00:00+00:00"}))

    printed = lousho("watch", "w-1", "--json")

    assert printed.code == 0
    assert "no longer matches the run" in printed.err
    assert json.loads(printed.out.splitlines()[0])["type"] == "run.start"


def test_watch_of_an_unknown_or_invalid_run_fails_with_its_code(lousho: Lousho) -> None:
    unknown = lousho("watch", "nope")
    invalid = lousho("watch", "bad id", "--json")
    bad_after = lousho("watch", "w-1", "--after", "-3")

    assert unknown.code == 1 and unknown.error_code() == "LOUSHO_CHECKPOINT_NOT_FOUND"
    assert invalid.code == 1 and invalid.json()["error"]["code"] == "LOUSHO_SESSION_ID_INVALID"
    assert bad_after.code == 2 and "not an event seq" in bad_after.err


def test_abort_requests_a_stop_and_leaves_a_finished_run_alone(lousho: Lousho, weather: Driver, client: Client) -> None:
    agent = client.agent("weather")
    agent.send("Weather in Oslo?", session_id="w-1")
    agent.send("Weather in Rome?", session_id="w-2")
    weather.drain("w-2")

    running = lousho("abort", "w-1")
    finished = lousho("abort", "w-2", "--json")
    unknown = lousho("abort", "nope")
    weather.drain("w-1")

    assert running.code == 0 and running.out.startswith("abort requested for w-1")
    assert (finished.code, finished.json()) == (0, {"session_id": "w-2", "aborting": False})
    assert unknown.code == 1 and unknown.error_code() == "LOUSHO_CHECKPOINT_NOT_FOUND"
    checkpoint = client.store.load("w-1")
    assert checkpoint is not None and checkpoint.finish_reason == "aborted"


def test_steer_gives_a_run_a_message_and_a_paused_run_refuses_it(
    lousho: Lousho, weather: Driver, paused: tuple[Driver, str], finished: str, client: Client
) -> None:
    steered = lousho("steer", finished, "Use Celsius", "--json")
    refused = lousho("steer", "b-1", "Hurry")
    weather.drain(finished)

    assert (steered.code, steered.json()) == (0, {"session_id": finished, "input": 2})
    assert refused.code == 1 and refused.error_code() == "LOUSHO_SESSION_AWAITING_APPROVAL"
    checkpoint = client.store.load(finished)
    assert checkpoint is not None and checkpoint.final_text == "Still sunny."
    assert [m.content for m in checkpoint.messages if m.role == "user"][-1] == "Use Celsius"


def test_watch_of_a_run_that_paused_was_approved_and_finished_shows_it_finished(
    lousho: Lousho, paused: tuple[Driver, str], client: Client
) -> None:
    driver, approval_id = paused
    client.agent("bank").approvals.resolve(approval_id, approved=True)
    driver.drain("b-1")

    printed = lousho("watch", "b-1")

    print(f"\n{printed.out}")
    assert printed.code == 0, printed.err
    lines = printed.out.splitlines()
    assert lines[0] == "-- input 1 (agent bank)"
    assert f'approval {approval_id} for transfer({{"amount": 10}}): approved' in lines
    assert any(line.startswith('tool transfer({"amount": 10}) done') and line.endswith(": moved 10") for line in lines)
    assert lines[-2] == "Done." and lines[-1].startswith("== stop after 2 step(s)")
    assert not [line for line in lines if "decide with" in line or line.startswith("waiting on approval")]


def test_watch_of_a_run_paused_on_an_undecided_approval_stops_there_with_how_to_decide(
    lousho: Lousho, paused: tuple[Driver, str]
) -> None:
    _, approval_id = paused

    printed = lousho("watch", "b-1")

    assert printed.code == 0, printed.err
    lines = printed.out.splitlines()
    hint = f"  decide with: lousho approvals approve {approval_id}  (or: lousho approvals reject {approval_id})"
    assert hint in lines
    assert lines[-1] == f"waiting on approval {approval_id}"


def test_watch_follow_keeps_following_later_inputs(
    lousho: Lousho, weather: Driver, client: Client, redis_client: redis.Redis
) -> None:
    agent = client.agent("weather")
    agent.send("Weather in Oslo?", session_id="w-1")
    weather.drain("w-1")

    def second_input() -> None:
        for _ in range(500):
            if _once_watched(redis_client, "w-1")():
                break
            time.sleep(0.02)
        agent.send("And now?", session_id="w-1")
        weather.drain("w-1")
        agent.send("Delete it", session_id="w-1")  # a third input, after which the run is deleted: the watch ends
        weather.drain("w-1")
        agent.delete("w-1")

    thread = threading.Thread(target=second_input, daemon=True)
    thread.start()
    printed = lousho("watch", "w-1", "--follow", "--no-live")
    thread.join(30)

    lines = printed.out.splitlines()
    print(f"\n{printed.out}{printed.err}")
    assert [line for line in lines if line.startswith("-- ")] == [
        "-- input 1 (agent weather)",
        "-- input 2 (agent weather)",
        "-- input 3 (agent weather)",
    ]
    assert "Still sunny." in lines and "Sunny again." in lines
    assert printed.error_code() == "LOUSHO_CHECKPOINT_NOT_FOUND"


def test_an_error_event_reaches_readers_with_its_message(
    lousho: Lousho, make_driver: Callable[..., Driver], client: Client
) -> None:
    def refuse(order: str) -> str:
        """Charge an order."""
        raise PropagatingToolError(f"card of {order} declined for good")

    driver = make_driver(
        Agent(
            name="payer",
            model=MockModel([{"tool_calls": [{"name": "refuse", "args": {"order": "o-7"}}]}, "never"]),
            tools=[tool(refuse)],
        )
    )
    client.agent("payer").send("Pay o-7", session_id="p-1")
    driver.drain("p-1")

    [error] = [event for event in client.read_events("p-1", -1) if event.type == "error"]
    printed = lousho("watch", "p-1", "--after", "-1")

    assert error.data["message"] == "card of o-7 declined for good"
    assert error.data["code"] == "LOUSHO_TOOL_PROPAGATED"
    assert "error LOUSHO_TOOL_PROPAGATED: card of o-7 declined for good" in printed.out.splitlines()
