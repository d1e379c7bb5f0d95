"""The invariant checker of the crash tests (RELIABILITY section 4), independent of the worker.

It reads only Postgres rows (``runs``, ``checkpoint_history``), the JSONL side-effect log written
by ``tests.support.agents`` and the fault events the test recorded, and never imports ``worker``:
a bug in the step machine must not be able to hide itself from the check.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg.rows import dict_row

from store import history as history_format

#: Environment variable naming the JSONL side-effect log.
LOG_ENV = "LOUSHO_TEST_LOG"
_RESPONSE = re.compile(r"\[resp:([0-9a-f]+)\]")
#: Saves this soon after a kill may still be the victim's own; recovery counts from the next one.
VICTIM_GRACE_S = 0.1
#: Invariants checked here; each passes or fails as a whole.
CHECKS = ("I1", "I2", "I3", "I4", "I5", "I7", "I10", "I12", "I18")
#: The idempotent sink the test tools write when ``EFFECTS_ENV`` is set (RELIABILITY section 4, check 6): one row
#: per tool call id, however often the call ran.
EFFECTS_TABLE = "test_effects"
EFFECTS_ENV = "LOUSHO_TEST_EFFECTS"
#: The test agents' tool that needs a human approval (RELIABILITY I5).
APPROVED_TOOL = "approved_work"
#: The tool of a lead whose calls run as child runs: its results come from the child, not from an execution.
SUBAGENT_TOOL = "task"
#: The test agents' ``once`` tools (RELIABILITY I18): with a ``reconcile`` function, and without one.
ONCE_TOOL, UNCHECKED_TOOL = "once_work", "once_unchecked"
ONCE_TOOLS = (ONCE_TOOL, UNCHECKED_TOOL)
#: The sink the ``once`` tools apply their effect to, one row per call naming the execution that applied it; their
#: ``reconcile`` reads it.
ONCE_TABLE = "test_once_effects"


def response_tag(nonce: str) -> str:
    """How a model response carries its id in the assistant text."""
    return f"[resp:{nonce}]"


def transcript_digest(messages: Iterable[Mapping[str, Any]]) -> str:
    """A digest of what a transcript says (roles, contents, call ids), equal for a dumped and a stored one.

    System messages are left out: they are the agent's instructions, which a run handed to another agent sends
    in place of the saved one.
    """
    shape = [
        [m.get("role"), m.get("content"), [c.get("id") for c in m.get("tool_calls") or ()], m.get("tool_call_id")]
        for m in messages
        if m.get("role") != "system"
    ]
    return hashlib.sha256(json.dumps(shape, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Fault:
    """One kill or stop done by a test: when, which processes, which runs' leases they held.

    ``carried`` names the other runs whose step message the victims held (received from the broker,
    not acked, no lease taken yet): a run recovering from an earlier fault is hit again when the
    message that would recover it dies with a worker.
    """

    ts: float
    action: str
    pids: tuple[int, ...]
    runs: tuple[str, ...]
    carried: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "ts": self.ts,
            "action": self.action,
            "pids": list(self.pids),
            "runs": list(self.runs),
            "carried": list(self.carried),
        }


@dataclass
class Episode:
    """One interruption of one run: the faults that touched it before it made progress again.

    A fault touches a run when the killed or stopped process held the run's lease. While the run is
    still recovering from an earlier fault (no save since that fault), a fault also touches it when
    the victims carried its step message: at that point nobody holds the lease, and the message the
    sweep sent to recover the run is what a second kill takes away. The recovery then starts over,
    so it is measured from the last touching fault, and the run counts as hit again.

    A kill that took neither the lease nor the message does not touch a recovering run: with a kill
    every few seconds nearly every recovery overlaps one, and restarting the clock at each would
    measure the chaos cadence instead of the recovery (a sweep slowed far past its budget would pass).
    """

    run: str
    faults: list[Fault]
    #: The first save after the last touching fault (None: the run never saved again).
    progress_at: float | None = None

    @property
    def since_last_s(self) -> float:
        """Recovery time: from the last fault that touched the run to its next save."""
        assert self.progress_at is not None
        return round(self.progress_at - self.faults[-1].ts, 3)

    @property
    def since_first_s(self) -> float:
        """How long the run stood still in all, from the first fault of the episode."""
        assert self.progress_at is not None
        return round(self.progress_at - self.faults[0].ts, 3)

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "action": self.faults[-1].action,
            "fault_ts": self.faults[-1].ts,
            "recovery_s": self.since_last_s,
            "faults": len(self.faults),
            "first_fault_ts": self.faults[0].ts,
            "actions": [f.action for f in self.faults],
            "since_first_s": self.since_first_s,
        }


def _progress_after(saved_at: Sequence[float], ts: float) -> float | None:
    # A victim can commit a save it sent in the milliseconds it takes to die: not progress.
    return next((at for at in saved_at if at > ts + VICTIM_GRACE_S), None)


def recovery_episodes(run_id: str, saves: Iterable[float], faults: Sequence[Fault]) -> list[Episode]:
    """The interruptions of run ``run_id`` whose saves were at ``saves`` (epoch seconds), in time order.

    See ``Episode`` for which faults touch a run.
    """
    saved_at = sorted(saves)
    episodes: list[Episode] = []
    for fault in sorted(faults, key=lambda f: f.ts):
        current = episodes[-1] if episodes else None
        if current is not None and (current.progress_at is None or fault.ts < current.progress_at):
            if run_id not in fault.runs and run_id not in fault.carried:
                continue
            current.faults.append(fault)
        elif run_id in fault.runs:
            current = Episode(run_id, [fault])
            episodes.append(current)
        else:
            continue
        current.progress_at = _progress_after(saved_at, fault.ts)
    return episodes


@dataclass
class _Save:
    seq: int
    fence: int
    status: str
    saved_at: float
    messages: list[dict[str, Any]]


@dataclass
class _Run:
    session_id: str
    status: str = ""
    seq: int = 0
    last_error: Any = None
    finish_reason: str | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    history: list[_Save] = field(default_factory=list)


def read_log(path: Path) -> list[dict[str, Any]]:
    """Every complete line of the JSONL log (a line cut by a kill is skipped)."""
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


def _load_runs(database_url: str) -> dict[str, _Run]:
    runs: dict[str, _Run] = {}
    with psycopg.connect(database_url, row_factory=dict_row) as conn:
        message_rows: dict[str, list[tuple[int, int, dict[str, Any]]]] = {}
        for row in conn.execute("SELECT session_id, slot, seq, message FROM run_messages ORDER BY session_id, slot"):
            message_rows.setdefault(row["session_id"], []).append((row["slot"], row["seq"], row["message"]))
        for row in conn.execute("SELECT session_id, status, seq, last_error, document FROM runs"):
            document = row["document"] or {}
            stored = message_rows.get(row["session_id"], [])
            # Format 2 keeps the transcript as rows; format 1 in the document.
            messages = [body for _, _, body in stored] if "messages_count" in document else document.get("messages")
            runs[row["session_id"]] = _Run(
                row["session_id"],
                row["status"],
                row["seq"],
                row["last_error"],
                document.get("finish_reason"),
                list(messages or []),
            )
        rows = conn.execute(
            "SELECT session_id, seq, fence, status, saved_at, document FROM checkpoint_history ORDER BY session_id, seq"
        ).fetchall()
    # Entries point at message rows (format 2) or share a prefix with the entry before them: rebuild them.
    by_run: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_run.setdefault(row["session_id"], []).append(row)
    for session_id, saves in by_run.items():
        documents = dict(
            history_format.expand(((r["seq"], r["document"] or {}) for r in saves), message_rows.get(session_id, []))
        )
        run = runs.setdefault(session_id, _Run(session_id, status="<deleted>"))
        for row in saves:
            if row["seq"] not in documents:
                raise AssertionError(f"history entry {row['seq']} of {session_id} cannot be rebuilt")
            run.history.append(
                _Save(
                    row["seq"],
                    row["fence"],
                    row["status"],
                    row["saved_at"].timestamp(),
                    list(documents[row["seq"]].get("messages") or []),
                )
            )
    return runs


def _tag(message: Mapping[str, Any]) -> str | None:
    found = _RESPONSE.search(str(message.get("content") or ""))
    return found.group(1) if found else None


def transcript_violations(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """Why a final transcript breaks I1/I4: each call answered once, in call order, right after its turn."""
    problems = []
    index = 0
    while index < len(messages):
        message = messages[index]
        index += 1
        if message.get("role") == "tool":
            problems.append(f"result {message.get('tool_call_id')!r} at {index - 1} follows no call turn")
            continue
        calls = [c.get("id") for c in message.get("tool_calls") or ()] if message.get("role") == "assistant" else []
        if not calls:
            continue
        answered = []
        while index < len(messages) and messages[index].get("role") == "tool":
            answered.append(messages[index].get("tool_call_id"))
            index += 1
        if answered != calls:
            problems.append(f"turn at {index - len(answered) - 1}: results {answered} != calls {calls}")
    return problems


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (nearest rank) of ``values``, rounded to the ms; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, math.ceil(q / 100 * len(ordered)) - 1)
    return round(ordered[rank], 3)


def _result_body(result: Mapping[str, Any]) -> dict[str, Any] | None:
    """A stored tool result's JSON object, or None when it is not one."""
    try:
        body = json.loads(str(result.get("content")))
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


class _Checker:
    def __init__(
        self, runs: dict[str, _Run], events: list[dict[str, Any]], expected: set[str] | None, faults: Sequence[Fault]
    ) -> None:
        self.runs = runs
        self.expected = expected if expected is not None else set(runs)
        self.faults = faults
        self.violations: dict[str, list[str]] = defaultdict(list)
        self.tools = [e for e in events if e.get("kind") == "tool"]
        self.models = [e for e in events if e.get("kind") == "model"]
        self.per_run: dict[str, dict[str, Any]] = {}
        #: The idempotent sink's rows (tool call id -> run id), when the test asked for check 6.
        self.effects: dict[str, str] | None = None
        self.effect_counts: dict[str, int] = {}
        #: The once sink's rows: tool call id -> the execution that applied the call's effect.
        self.once_applied: dict[str, str] = {}
        #: Log position of each execution's start line: (run, call, exec) -> index (the log is one ordered file).
        self.start_index = {
            (e["run_id"], e["tool_call_id"], e["exec"]): k
            for k, e in enumerate(events)
            if e.get("kind") == "tool" and e.get("phase") == "start"
        }
        self.once_figures = {
            "once_calls": 0,
            "once_reexecutions": 0,
            "once_reruns": 0,
            "reconciled_results": 0,
            "reconcile_calls": sum(1 for e in events if e.get("kind") == "reconcile"),
        }

    def fail(self, check: str, message: str) -> None:
        self.violations[check].append(message)

    def run(self) -> dict[str, Any]:
        for sid in sorted(self.expected - set(self.runs)):
            self.fail("I10", f"{sid}: run was never stored")
        for run in self.runs.values():
            self.per_run[run.session_id] = {
                "raw_reexecutions": 0,
                "wasted_model_calls": 0,
                "interrupted_model_calls": 0,
                "executions": 0,
                "interrupted_results": 0,
                "once_reexecutions": 0,
                "reconciled_results": 0,
            }
            self.check_history(run)
            self.check_finished(run)
            self.check_transcript(run)
        self.check_tools()
        self.check_models()
        if self.effects is not None:
            self.check_effects(self.effects)
        return self.report()

    def check_effects(self, applied: dict[str, str]) -> None:
        """I12: each recorded result's effect applied once; no effect without an execution or outside a transcript.

        A kill can fall between an effect and the log line that reports it, so effects are matched to executions
        that started and to results that were recorded, never to the effect log lines one for one.
        """
        started = {str(e["tool_call_id"]) for e in self.tools if e.get("phase") == "start"}
        asked: set[str] = set()
        recorded: dict[str, str] = {}
        for run in self.runs.values():
            for message in run.messages:
                if message.get("role") == "assistant":
                    asked.update(str(call.get("id")) for call in message.get("tool_calls") or ())
                elif message.get("role") == "tool" and "exec" in (_result_body(message) or {}):
                    recorded[str(message.get("tool_call_id"))] = run.session_id  # an execution's own result
        for call_id in sorted(set(recorded) - set(applied)):
            self.fail("I12", f"{recorded[call_id]}: result of {call_id} recorded but its effect never applied")
        for call_id in sorted(set(applied) - started):
            self.fail("I12", f"{applied[call_id]}: effect of {call_id} applied with no execution logged")
        orphans = sorted(set(applied) - asked)
        for call_id in orphans:
            self.fail("I12", f"{applied[call_id]}: orphan effect {call_id} (its call is in no transcript)")
        self.effect_counts = {
            "applied_effects": len(applied),
            "raw_effects": sum(1 for e in self.tools if e.get("phase") == "effect"),
            "orphan_effects": len(orphans),
        }

    def check_history(self, run: _Run) -> None:
        seqs = [save.seq for save in run.history]
        if seqs != list(range(1, len(seqs) + 1)):
            self.fail("I7", f"{run.session_id}: history seqs not contiguous from 1: {seqs[:5]}...")
        if run.status != "<deleted>" and seqs and seqs[-1] != run.seq:
            self.fail("I7", f"{run.session_id}: last history seq {seqs[-1]} != run seq {run.seq}")
        for before, after in zip(run.history, run.history[1:], strict=False):
            if after.fence < before.fence:
                self.fail("I7", f"{run.session_id}: fence fell from {before.fence} to {after.fence} at seq {after.seq}")
        # Once recorded, a turn or a result never changes: a late save merged over it would show here.
        seen: dict[str, Any] = {}
        for save in run.history:
            for position, message in enumerate(_turn_keys(save.messages)):
                key, value = message
                if key in seen and seen[key] != value:
                    check = "I3" if key.startswith("turn") else "I2"
                    self.fail(check, f"{run.session_id}: {key} changed at seq {save.seq} (position {position})")
                seen.setdefault(key, value)

    def check_finished(self, run: _Run) -> None:
        if run.session_id not in self.expected:
            return
        if run.status != "finished" or run.finish_reason != "stop":
            self.fail(
                "I10",
                f"{run.session_id}: status {run.status!r} finish_reason {run.finish_reason!r} "
                f"seq {run.seq} last_error {run.last_error}",
            )

    def check_transcript(self, run: _Run) -> None:
        for problem in transcript_violations(run.messages):
            self.fail("I1", f"{run.session_id}: {problem}")

    def first_result_seq(self, run: _Run) -> dict[str, int]:
        first: dict[str, int] = {}
        for save in run.history:
            for message in save.messages:
                if message.get("role") == "tool":
                    first.setdefault(str(message.get("tool_call_id")), save.seq)
        return first

    def check_tools(self) -> None:
        starts: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
        ended = {(e["run_id"], e["tool_call_id"], e["exec"]) for e in self.tools if e["phase"] == "end"}
        for event in self.tools:
            if event["phase"] == "start":
                starts[(event["run_id"], event["tool_call_id"])].append(event)
        for run in self.runs.values():
            first = self.first_result_seq(run)
            calls = {
                str(c.get("id")): str(c.get("name"))
                for m in run.messages
                if m.get("role") == "assistant"
                for c in m.get("tool_calls") or ()
            }
            results = {str(m.get("tool_call_id")): m for m in run.messages if m.get("role") == "tool"}
            figures = self.per_run[run.session_id]
            for call_id, name in sorted(calls.items()):
                executions = starts.get((run.session_id, call_id), [])
                figures["executions"] += len(executions)
                figures["raw_reexecutions"] += max(0, len(executions) - 1)
                recorded = first.get(call_id)
                for execution in executions:
                    if recorded is not None and execution["base_seq"] >= recorded:
                        self.fail(
                            "I2",
                            f"{run.session_id}: {call_id} executed from seq {execution['base_seq']}"
                            f" though its result was recorded at seq {recorded}",
                        )
                result = results.get(call_id)
                if name in ONCE_TOOLS:
                    self.check_once(run.session_id, call_id, executions, result)
                elif result is not None:
                    self.check_result(run.session_id, call_id, name, result, executions, ended)
        for (sid, call_id), executions in starts.items():
            stored = self.runs.get(sid)
            known = {c.get("id") for m in (stored.messages if stored else []) for c in m.get("tool_calls") or ()}
            if call_id not in known:
                self.fail("I2", f"{sid}: {len(executions)} execution(s) of {call_id}, a call in no transcript")

    def check_once(
        self, sid: str, call_id: str, executions: list[dict[str, Any]], result: Mapping[str, Any] | None
    ) -> None:
        """I18: no execution of a ``once`` call starts after the one that applied its effect; results are true.

        Clock-free: the log is one file every process appends whole lines to, so a start line written after the
        applying execution's start line is an execution that began after it. A reconciled result must name the
        execution that applied the effect; an execution's own result must come from it.
        """
        figures = self.per_run[sid]
        self.once_figures["once_calls"] += 1
        applied = self.once_applied.get(call_id)
        starts = sorted(self.start_index.get((sid, call_id, e["exec"]), -1) for e in executions)
        if applied is not None:
            applied_at = self.start_index.get((sid, call_id, applied))
            if applied_at is None:
                self.fail(
                    "I18", f"{sid}: the effect of once call {call_id} was applied by {applied}, which never started"
                )
            else:
                again = sum(1 for index in starts if index > applied_at)
                figures["once_reexecutions"] += again
                self.once_figures["once_reexecutions"] += again
                self.once_figures["once_reruns"] += sum(1 for index in starts if index < applied_at)
                if again:
                    self.fail(
                        "I18",
                        f"{sid}: once call {call_id} executed {again} more time(s) after {applied} applied its effect",
                    )
        body = _result_body(result) if result is not None else None
        if result is None or body is None:
            return
        if body.get("reconciled"):
            figures["reconciled_results"] += 1
            self.once_figures["reconciled_results"] += 1
        if "exec" in body and body["exec"] != applied:
            self.fail(
                "I18",
                f"{sid}: once call {call_id} has the result of {body['exec']}, but"
                f" {applied or 'no execution'} applied its effect",
            )

    def check_result(
        self,
        sid: str,
        call_id: str,
        name: str,
        result: Mapping[str, Any],
        executions: list[dict[str, Any]],
        ended: set[tuple[str, str, str]],
    ) -> None:
        """A recorded result is a logged execution's output, or (approved calls only) ``interrupted``.

        A result that a person (a question), a hook (denied, approved arguments kept), a handoff or a sub-agent (a
        ``task`` call: its child run's final text) gave comes from no execution.
        """
        body = _result_body(result)
        if body is None and name != SUBAGENT_TOOL:
            self.fail("I1", f"{sid}: result of {call_id} is neither a tool's output nor a structured result")
            return
        body = body or {}
        approved = name == APPROVED_TOOL
        if (
            name in ("ask_question", SUBAGENT_TOOL)
            or body.get("kind") == "denied"
            or "transferred_to" in body
            or body.get("error") in ("ApprovedArgsChanged", "HandoffNotHonoured")
        ):
            if executions:
                self.fail("I2", f"{sid}: {call_id}, settled without running, executed")
            return
        if approved and len(executions) > 1:
            self.fail("I5", f"{sid}: approved call {call_id} ran {len(executions)} times")
        if body.get("kind") == "interrupted":
            self.per_run[sid]["interrupted_results"] += 1
            if not approved:
                self.fail("I5", f"{sid}: {call_id} got an interrupted result but needs no approval")
            return
        if body.get("kind") == "rejected" and approved:
            # A human said no: the call must not have run at all.
            if executions:
                self.fail("I5", f"{sid}: rejected call {call_id} ran {len(executions)} time(s)")
            return
        if "exec" not in body:
            self.fail("I1", f"{sid}: result of {call_id} is an unexpected error: {body.get('error')}")
        elif (sid, call_id, body["exec"]) not in ended:
            self.fail("I2", f"{sid}: result of {call_id} comes from no logged execution")
        elif approved and len(executions) != 1:
            self.fail("I5", f"{sid}: approved call {call_id} has a result from {len(executions)} executions")

    def check_unlogged_turns(self, logged: set[str]) -> None:
        """A logged model's turn always comes from a logged call of its run.

        (A child run made under another id than the one its lead named would have turns and no calls.)
        """
        for sid, run in self.runs.items():
            tags = [_tag(m) for m in run.messages if m.get("role") == "assistant"]
            if sid not in logged and any(tag is not None for tag in tags):
                self.fail("I3", f"{sid}: {len(tags)} turn(s) and no logged model call of this run")

    def check_models(self) -> None:
        by_run: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for event in self.models:
            by_run[event["run_id"]].append(event)
            if event["phase"] == "start" and not event.get("transcript_valid"):
                self.fail("I4", f"{event['run_id']}: model got an invalid transcript: {event.get('problems')}")
        self.check_unlogged_turns(set(by_run))
        for sid, events in by_run.items():
            run = self.runs.get(sid)
            if run is None:
                continue
            figures = self.per_run[sid]
            ended = {e["call"] for e in events if e["phase"] == "end"}
            figures["interrupted_model_calls"] = sum(
                1 for e in events if e["phase"] == "start" and e["call"] not in ended
            )
            responses = [e["response_id"] for e in events if e["phase"] == "end"]
            turns = [_tag(m) for m in run.messages if m.get("role") == "assistant"]
            for k, tag in enumerate(turns):
                if tag is None or tag not in responses:
                    self.fail("I3", f"{sid}: turn {k} carries response {tag!r}, which no logged model call gave")
            figures["wasted_model_calls"] = sum(1 for r in responses if r not in turns)
            recorded_at = _turn_seqs(run)
            digests = _base_digests(run)
            for event in events:
                if event["phase"] != "start":
                    continue
                k = event["turn_index"]
                base = digests.get(event["digest"])
                if base is None and k > 0:
                    self.fail("I3", f"{sid}: model call for turn {k} from a transcript no checkpoint holds")
                if base is not None and k in recorded_at and base >= recorded_at[k]:
                    self.fail("I3", f"{sid}: turn {k} regenerated from seq {base} (recorded at seq {recorded_at[k]})")

    def recovery(self) -> dict[str, Any]:
        """Recovery figures (check 10), one per episode, each measured from the last fault that touched the run."""
        episodes = [
            episode
            for sid in sorted(self.runs)
            for episode in recovery_episodes(sid, (s.saved_at for s in self.runs[sid].history), self.faults)
        ]
        measured = [e for e in episodes if e.progress_at is not None]
        stuck = {e.run for e in episodes if e.progress_at is None and self.runs[e.run].status != "finished"}
        unrecovered = sorted(stuck | {sid for fault in self.faults for sid in fault.runs if sid not in self.runs})
        times = [e.since_last_s for e in measured]
        by_run: dict[str, float] = {}
        for episode in measured:
            by_run[episode.run] = max(by_run.get(episode.run, 0.0), episode.since_last_s)
        hit_again = [e for e in measured if len(e.faults) > 1]
        return {
            "faults": len(self.faults),
            "affected": len(measured) + len(unrecovered),
            "count": len(times),
            "p50_s": percentile(times, 50),
            "p99_s": percentile(times, 99),
            "max_s": round(max(times), 3) if times else None,
            "unrecovered": unrecovered,
            "by_run_s": by_run,
            "slowest": [e.to_json() for e in sorted(measured, key=lambda e: -e.since_last_s)[:3]],
            "hit_again": {
                "count": len(hit_again),
                "max_since_first_s": round(max(e.since_first_s for e in hit_again), 3) if hit_again else None,
                "runs": [e.to_json() for e in hit_again],
            },
        }

    def report(self) -> dict[str, Any]:
        for sid in self.recovery()["unrecovered"]:
            self.fail("I10", f"{sid}: no save after the fault that hit it")
        totals = {
            key: sum(f[key] for f in self.per_run.values())
            for key in (
                "raw_reexecutions",
                "wasted_model_calls",
                "interrupted_model_calls",
                "executions",
                "interrupted_results",
            )
        }
        violations = [f"{check}: {message}" for check in CHECKS for message in self.violations.get(check, [])]
        return {
            **self.once_figures,
            "runs": len(self.expected),
            "finished": sum(1 for sid in self.expected if sid in self.runs and self.runs[sid].status == "finished"),
            "model_calls": sum(1 for e in self.models if e["phase"] == "start"),
            **totals,
            **self.effect_counts,
            "checks": {
                check: "fail" if self.violations.get(check) else "pass"
                for check in CHECKS
                if check != "I12" or self.effects is not None
            },
            "violations": violations,
            "per_run": self.per_run,
            "recovery": self.recovery(),
        }


def _base_digests(run: _Run) -> dict[str, int]:
    """Digest of each transcript a model call can start from -> the seq of the checkpoint it comes from.

    A checkpoint's own transcript; and, when new input (a follow-up) was queued after it, the transcript plus
    that input, which the answering turn sees and which is saved only together with the answer.
    """
    digests: dict[str, int] = {}
    for save in run.history:
        digests[transcript_digest(save.messages)] = save.seq
        size = len(save.messages)
        if run.messages[:size] == save.messages:
            queued = list(itertools.takewhile(lambda m: m.get("role") == "user", run.messages[size:]))
            if queued:
                digests[transcript_digest([*save.messages, *queued])] = save.seq
    return digests


def _turn_keys(messages: Sequence[Mapping[str, Any]]) -> list[tuple[str, Any]]:
    keys: list[tuple[str, Any]] = []
    turn = 0
    for message in messages:
        if message.get("role") == "assistant":
            keys.append(
                (f"turn {turn}", (message.get("content"), [c.get("id") for c in message.get("tool_calls") or ()]))
            )
            turn += 1
        elif message.get("role") == "tool":
            keys.append((f"result {message.get('tool_call_id')}", message.get("content")))
    return keys


def _turn_seqs(run: _Run) -> dict[int, int]:
    recorded: dict[int, int] = {}
    for save in run.history:
        turns = sum(1 for m in save.messages if m.get("role") == "assistant")
        for k in range(turns):
            recorded.setdefault(k, save.seq)
    return recorded


def prepare_once_sink(database_url: str) -> None:
    """Create (or empty) the sink the ``once`` tools apply their effect to (I18)."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            f"CREATE TABLE IF NOT EXISTS {ONCE_TABLE} (idem_key text PRIMARY KEY, exec text NOT NULL,"
            " run_id text NOT NULL)"
        )
        conn.execute(f"TRUNCATE {ONCE_TABLE}")


def _load_once(database_url: str) -> dict[str, str]:
    with psycopg.connect(database_url) as conn:
        if conn.execute("SELECT to_regclass(%s)", (ONCE_TABLE,)).fetchone() == (None,):
            return {}
        return {str(key): str(execution) for key, execution in conn.execute(f"SELECT idem_key, exec FROM {ONCE_TABLE}")}


def prepare_effects(database_url: str) -> None:
    """Create (or empty) the idempotent effects sink of check 6 (I12)."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            f"CREATE TABLE IF NOT EXISTS {EFFECTS_TABLE} (idem_key text PRIMARY KEY, run_id text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        )
        conn.execute(f"TRUNCATE {EFFECTS_TABLE}")


def _load_effects(database_url: str) -> dict[str, str] | None:
    with psycopg.connect(database_url) as conn:
        if conn.execute("SELECT to_regclass(%s)", (EFFECTS_TABLE,)).fetchone() == (None,):
            return None
        return {str(key): str(run) for key, run in conn.execute(f"SELECT idem_key, run_id FROM {EFFECTS_TABLE}")}


def check(
    database_url: str,
    log_path: Path,
    *,
    expected: Iterable[str] | None = None,
    faults: Sequence[Fault] = (),
    effects: bool = False,
) -> dict[str, Any]:
    """Check every run in the database against I1-I5, I7, I10 and I18 and measure recovery after ``faults``.

    ``expected`` names the runs that must exist and have finished (default: every stored run). With ``effects``
    the tools wrote the idempotent sink (``prepare_effects`` and ``EFFECTS_ENV``), and I12 is checked too.
    """
    runs = _load_runs(database_url)
    checker = _Checker(runs, read_log(log_path), set(expected) if expected is not None else None, faults)
    checker.once_applied = _load_once(database_url)
    if effects:
        applied = _load_effects(database_url)
        if applied is None:
            raise AssertionError(f"no {EFFECTS_TABLE} table: call prepare_effects before the workers start")
        checker.effects = applied
    return checker.run()


def print_report(report: Mapping[str, Any], title: str = "") -> None:
    """Print the JSON report (without the per-run table) and the ``checker: N passed, M failed`` line."""
    shown = {key: value for key, value in report.items() if key != "per_run"}
    shown["recovery"] = {k: v for k, v in report["recovery"].items() if k != "by_run_s"}
    print(f"\n== {title} ==" if title else "")
    print(json.dumps(shown, indent=2, default=str))
    passed = sum(1 for result in report["checks"].values() if result == "pass")
    print(f"checker: {passed} passed, {len(report['checks']) - passed} failed")


def assert_clean(report: Mapping[str, Any]) -> None:
    """Fail the test with the first violations when the checker found any."""
    violations = report["violations"]
    assert not violations, f"{len(violations)} violation(s):\n" + "\n".join(violations[:20])
