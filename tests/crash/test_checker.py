"""Negative controls for the checker: hand-made histories and logs with one known violation each.

A checker that can no longer see a bug would let every crash test pass vacuously; each case here
must be reported under its invariant, and the clean case must pass.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.support import checker, services
from tests.support.checker import APPROVED_TOOL, Fault, recovery_episodes, response_tag, transcript_digest

Messages = list[dict[str, Any]]


def _user(run_id: str) -> Messages:
    return [{"role": "system", "content": "Crash-test agent."}, {"role": "user", "content": f"run {run_id}"}]


def _turn(nonce: str, calls: list[str], tool: str = "work") -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": f"turn {response_tag(nonce)}",
        "tool_calls": [{"id": c, "name": tool, "args": {"ms": 1}} for c in calls],
    }


def _result(call: str, execution: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call, "name": "work", "content": json.dumps({"exec": execution})}


class _Fixture:
    """One run written as history rows plus the log lines its model and tools would have written."""

    def __init__(self, run_id: str, tool: str = "work") -> None:
        self.run_id = run_id
        self.tool = tool
        self.saves: list[tuple[int, Messages, str]] = []
        self.events: list[dict[str, Any]] = []
        self.fences: list[int] = []

    def clean(self) -> _Fixture:
        """Model turn with calls a, b; both results; final text."""
        base = _user(self.run_id)
        self.model(0, base, "aa01", ["a", "b"])
        turn = [*base, _turn("aa01", ["a", "b"], self.tool)]
        self.save(turn)
        self.tool_run("a", 1, "x1")
        self.save([*turn, _result("a", "x1")])
        self.tool_run("b", 1, "x2")
        done = [*turn, _result("a", "x1"), _result("b", "x2")]
        self.save(done)
        self.model(1, done, "aa02", [])
        self.save([*done, {"role": "assistant", "content": f"done {response_tag('aa02')}"}], "finished")
        return self

    def model(self, turn: int, seen: Messages, nonce: str, calls: list[str], valid: bool = True) -> None:
        call = f"m{len(self.events)}"
        common = {
            "kind": "model",
            "call": call,
            "run_id": self.run_id,
            "turn_index": turn,
            "pid": 1,
            "ts": 0.0,
            "transcript_valid": valid,
        }
        self.events += [
            {**common, "phase": "start", "digest": transcript_digest(seen)},
            {**common, "phase": "end", "response_id": nonce, "tool_call_ids": calls},
        ]

    def tool_run(self, call: str, base_seq: int, execution: str) -> None:
        common = {
            "kind": "tool",
            "run_id": self.run_id,
            "tool_call_id": call,
            "base_seq": base_seq,
            "exec": execution,
            "pid": 1,
            "ts": 0.0,
            "approved": self.tool == APPROVED_TOOL,
        }
        self.events += [{**common, "phase": "start"}, {**common, "phase": "end"}]

    def save(self, messages: Messages, status: str = "in-progress") -> None:
        self.saves.append((len(self.saves) + 1, messages, status))

    def write(self, log: Path) -> None:
        fences = self.fences or [len(self.saves)] * len(self.saves)
        final_seq, final_messages, final_status = self.saves[-1]
        document = {"messages": final_messages, "finish_reason": "stop" if final_status == "finished" else None}
        with psycopg.connect(services.test_database_url(), autocommit=True) as conn:
            conn.execute(
                "INSERT INTO runs (session_id, agent, status, seq, fence, document)"
                " VALUES (%s, 'chaos', %s, %s, %s, %s)",
                (self.run_id, final_status, final_seq, fences[-1], json.dumps(document)),
            )
            for (seq, messages, status), fence in zip(self.saves, fences, strict=True):
                conn.execute(
                    "INSERT INTO checkpoint_history (session_id, seq, fence, step, status, document)"
                    " VALUES (%s, %s, %s, 0, %s, %s)",
                    (self.run_id, seq, fence, status, json.dumps({"messages": messages})),
                )
        with open(log, "a") as out:
            out.writelines(json.dumps(event) + "\n" for event in self.events)


def _fence_falls(f: _Fixture) -> None:
    f.clean()
    f.fences = [1, 3, 2, 3]


def _recorded_result_rerun(f: _Fixture) -> None:
    f.clean()
    f.tool_run("a", 2, "x3")


def _results_out_of_order(f: _Fixture) -> None:
    f.clean()
    turn = [*_user(f.run_id), _turn("aa01", ["a", "b"])]
    swapped = [*turn, _result("b", "x2"), _result("a", "x1")]
    f.saves[-1] = (5, [*swapped, {"role": "assistant", "content": f"done {response_tag('aa02')}"}], "finished")


def _turn_regenerated(f: _Fixture) -> None:
    f.clean()
    _, messages, status = f.saves[-1]
    f.model(1, messages[:-1], "aa09", [])
    f.save([*messages[:-1], {"role": "assistant", "content": f"done {response_tag('aa09')}"}], status)


def _invalid_transcript(f: _Fixture) -> None:
    f.clean()
    f.model(1, _user(f.run_id), "aa08", [], valid=False)


def _unfinished(f: _Fixture) -> None:
    f.clean()
    f.saves.pop()


def _approved_call_twice(f: _Fixture) -> None:
    f.tool = APPROVED_TOOL
    f.clean()
    f.tool_run("b", 1, "x4")


CASES: list[tuple[str, Callable[[_Fixture], None]]] = [
    ("I7", _fence_falls),
    ("I2", _recorded_result_rerun),
    ("I1", _results_out_of_order),
    ("I3", _turn_regenerated),
    ("I4", _invalid_transcript),
    ("I10", _unfinished),
    ("I5", _approved_call_twice),
]


def test_clean_history_passes(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    _Fixture("nc-clean").clean().write(log)
    report = checker.check(services.test_database_url(), log)
    checker.assert_clean(report)
    assert report["executions"] == 2 and report["raw_reexecutions"] == 0


@pytest.mark.parametrize(("invariant", "corrupt"), CASES, ids=[c[0] for c in CASES])
def test_checker_reports_the_violation(tmp_path: Path, invariant: str, corrupt: Callable[[_Fixture], None]) -> None:
    log = tmp_path / "events.jsonl"
    _Fixture("nc-good").clean().write(log)
    bad = _Fixture("nc-bad")
    corrupt(bad)
    bad.write(log)
    report = checker.check(services.test_database_url(), log)
    assert report["checks"][invariant] == "fail", report["violations"]
    assert all("nc-bad" in violation for violation in report["violations"]), report["violations"]


def _kill(ts: float, held: tuple[str, ...] = (), carried: tuple[str, ...] = (), action: str = "kill-group") -> Fault:
    return Fault(ts, action, (100 + int(ts),), held, carried)


def test_recovery_of_a_run_hit_again_while_recovering_counts_from_the_last_hit() -> None:
    # Killed at 0; the sweep re-sent it and the process running that step was killed at 2.8
    # before it saved; it saved at 5.9 (and a victim's own save at 2.85 is not progress).
    saves = [-0.4, 2.85, 5.9, 6.0]
    [episode] = recovery_episodes("r", saves, [_kill(0.0, ("r",)), _kill(2.8, ("r",))])
    assert (episode.since_last_s, episode.since_first_s, len(episode.faults)) == (3.1, 5.9, 2)


def test_a_kill_that_took_the_recovering_runs_message_touches_it_and_one_that_did_not_does_not() -> None:
    saves = [-0.4, 5.0]
    faults = [_kill(0.0, ("r",)), _kill(2.0, ("other",), action="kill-child"), _kill(3.0, carried=("r",))]
    [episode] = recovery_episodes("r", saves, faults)
    assert [f.ts for f in episode.faults] == [0.0, 3.0] and episode.since_last_s == 2.0
    [alone] = recovery_episodes("r", saves, faults[:2])
    assert len(alone.faults) == 1 and alone.since_last_s == 5.0


def test_a_hit_after_the_run_progressed_is_a_new_interruption() -> None:
    saves = [-0.4, 3.0, 3.2, 7.5]
    faults = [_kill(0.0, ("r",)), _kill(4.0, ("r",)), _kill(5.0, carried=("r",)), _kill(8.0, carried=("r",))]
    episodes = recovery_episodes("r", saves, faults)
    # The kill at 8 came after the last save: carrying its message starts nothing (only a lease does).
    assert [(len(e.faults), e.since_last_s) for e in episodes] == [(1, 3.0), (2, 2.5)]


def test_the_recovery_report_lists_runs_hit_again_apart() -> None:
    runs = {
        run: checker._Run(
            run,
            status="finished",
            seq=len(at),
            history=[checker._Save(n + 1, 1, "in-progress", ts, []) for n, ts in enumerate(at)],
        )
        for run, at in {"r": [-0.4, 5.9], "s": [-0.2, 3.0]}.items()
    }
    recovery = checker._Checker(runs, [], None, [_kill(0.0, ("r", "s")), _kill(2.8, ("r",))]).recovery()
    assert (recovery["count"], recovery["max_s"], recovery["by_run_s"]) == (2, 3.1, {"r": 3.1, "s": 3.0})
    again = recovery["hit_again"]
    assert again["count"] == 1 and again["max_since_first_s"] == 5.9
    assert [(r["run"], r["faults"], r["recovery_s"], r["since_first_s"]) for r in again["runs"]] == [("r", 2, 3.1, 5.9)]


def _effects(rows: list[tuple[str, str]]) -> None:
    checker.prepare_effects(services.test_database_url())
    with psycopg.connect(services.test_database_url(), autocommit=True) as conn:
        for call, run in rows:
            conn.execute(f"INSERT INTO {checker.EFFECTS_TABLE} (idem_key, run_id) VALUES (%s, %s)", (call, run))


@pytest.mark.parametrize(
    "rows",
    [
        [("a", "nc-fx")],  # b's result is recorded but its effect never applied
        [("a", "nc-fx"), ("b", "nc-fx"), ("z", "nc-fx")],  # z: an effect of a call no transcript asked for
    ],
    ids=["lost-effect", "orphan-effect"],
)
def test_the_applied_effects_check_reports_lost_and_orphan_effects(tmp_path: Path, rows: list[tuple[str, str]]) -> None:
    log = tmp_path / "events.jsonl"
    fixture = _Fixture("nc-fx").clean()
    fixture.tool_run("z", 1, "x9")  # an execution of z is logged, so only the transcript can tell it is an orphan
    fixture.write(log)
    _effects(rows)
    report = checker.check(services.test_database_url(), log, effects=True)
    assert report["checks"]["I12"] == "fail", report["violations"]
    _effects([("a", "nc-fx"), ("b", "nc-fx")])
    assert checker.check(services.test_database_url(), log, effects=True)["checks"]["I12"] == "pass"


def _once_sink(rows: list[tuple[str, str, str]]) -> None:
    checker.prepare_once_sink(services.test_database_url())
    with psycopg.connect(services.test_database_url(), autocommit=True) as conn:
        for call, execution, run in rows:
            conn.execute(
                f"INSERT INTO {checker.ONCE_TABLE} (idem_key, exec, run_id) VALUES (%s, %s, %s)", (call, execution, run)
            )


def _once_run(run_id: str, *, rerun_after_effect: bool = False, reconciled_as: str | None = None) -> _Fixture:
    """Calls a, b of a once tool; a was interrupted before its effect (x0) and ran again (x1)."""
    fixture = _Fixture(run_id, tool=checker.ONCE_TOOL)
    fixture.events.append(
        {
            "kind": "tool",
            "run_id": run_id,
            "tool_call_id": "a",
            "base_seq": 1,
            "exec": "x0",
            "pid": 1,
            "ts": 0.0,
            "approved": False,
            "phase": "start",
        }
    )
    fixture.clean()
    if rerun_after_effect:
        fixture.tool_run("b", 2, "x3")  # b ran again after x2 applied its effect
    if reconciled_as is not None:
        seq, messages, status = fixture.saves[2]
        reconciled = {
            "role": "tool",
            "tool_call_id": "b",
            "name": checker.ONCE_TOOL,
            "content": json.dumps({"exec": reconciled_as, "reconciled": True}),
        }
        fixture.saves[2] = (seq, [*messages[:-1], reconciled], status)
        final = fixture.saves[3]
        fixture.saves[3] = (final[0], [*final[1][:-2], reconciled, final[1][-1]], final[2])
    return fixture


@pytest.mark.parametrize(
    ("shape", "verdict"),
    [
        ({}, "pass"),
        ({"reconciled_as": "x2"}, "pass"),
        ({"rerun_after_effect": True}, "fail"),  # ran again once its effect was applied
        ({"reconciled_as": "x9"}, "fail"),  # a reconciled result naming an execution that applied nothing
    ],
    ids=["rerun-before-effect", "reconciled", "rerun-after-effect", "false-reconciliation"],
)
def test_the_once_check_reports_an_execution_after_the_effect(
    tmp_path: Path, shape: dict[str, Any], verdict: str
) -> None:
    log = tmp_path / "events.jsonl"
    _once_run("nc-once", **shape).write(log)
    _once_sink([("a", "x1", "nc-once"), ("b", "x2", "nc-once")])
    report = checker.check(services.test_database_url(), log)
    assert report["checks"]["I18"] == verdict, report["violations"]
    assert report["once_calls"] == 2 and report["once_reruns"] == 1
    assert report["once_reexecutions"] == (1 if shape.get("rerun_after_effect") else 0)
