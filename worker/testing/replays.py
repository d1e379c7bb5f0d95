"""``replay``: a recorded run's inputs, decisions and tool results through an agent, and where its turns diverge.

The recording (``store.recordings``, from ``Client.export``) is replayed on ``run_local``'s runtime. By default the
agent's own model answers and each of its turns is compared with the recorded one (text, and each call's tool and
arguments); ``model="recorded"`` serves the recorded turns instead and compares what the agent asks the model
(instructions and tool schemas by their hashes, and the messages) with what the recorded run asked. With
``tools="recorded"`` a call gets the recorded result of the same tool with the same arguments (a call the
recording does not have gets an error result, and is listed); ``tools="execute"`` runs the tools.
"""

from __future__ import annotations

import contextlib
import json
from collections import defaultdict, deque
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from store import errors
from store.recordings import RecordedDecision, RecordedResult, RecordedTurn, Recording, call_key
from store.records import Approval, Message
from store.redaction import redact
from store.summaries import RunResult
from worker.agents import Agent, Tool, ToolContext
from worker.providers import MockModel
from worker.testing.local import LocalRuntime

__all__ = ["ReplayReport", "TurnDiff", "replay"]


class TurnDiff(BaseModel):
    """One model turn, recorded and replayed (None where one side has no such turn)."""

    model_config = ConfigDict(frozen=True)

    #: The recorded turn's step (history numbering), or the replayed one's past the recording's end.
    step: int
    recorded: dict[str, Any] | None
    replayed: dict[str, Any] | None

    @property
    def same(self) -> bool:
        """Whether both sides said the same thing."""
        return self.recorded == self.replayed


class ReplayReport(BaseModel):
    """What a replay found: the first step where the turns (or requests) differ, the comparison from there, the end.

    ``diverged_at`` is None when every turn matched. ``requests`` lists the differences of what the agent asked the
    model (``model="recorded"``); ``unrecorded_calls`` the calls the recording had no result for, ``undecided`` the
    approvals it had no decision for (``tools="recorded"``).
    """

    model_config = ConfigDict(frozen=True)

    diverged_at: int | None
    turns: list[TurnDiff]
    requests: list[str] = Field(default_factory=list)
    unrecorded_calls: list[str] = Field(default_factory=list)
    undecided: list[str] = Field(default_factory=list)
    result: RunResult
    recorded_finish_reason: str | None = None

    @property
    def diverged(self) -> bool:
        """Whether the replay differs from the recording."""
        return self.diverged_at is not None

    def describe(self) -> str:
        """The report as lines for a terminal."""
        if not self.diverged:
            lines = [f"no divergence: {len(self.turns)} turn(s) as recorded"]
        else:
            lines = [f"diverged at step {self.diverged_at}"]
            for diff in self.turns:
                mark = "  " if diff.same else "≠ "
                lines.append(f"{mark}step {diff.step}: recorded {_short(diff.recorded)}")
                lines.append(f"{' ' * len(mark)}{' ' * len(f'step {diff.step}: ')}replayed {_short(diff.replayed)}")
        lines.extend(f"request differs: {text}" for text in self.requests)
        lines.extend(f"no recorded result for {call}" for call in self.unrecorded_calls)
        lines.extend(f"no recorded decision for {call}" for call in self.undecided)
        finish = self.result.finish_reason
        lines.append(f"finished: {finish} (recorded: {self.recorded_finish_reason}); text {self.result.text!r}")
        return "\n".join(lines)


def _short(turn: dict[str, Any] | None) -> str:
    return "nothing" if turn is None else json.dumps(turn, sort_keys=True, default=str)[:200]


def _turn(text: str | None, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """What is compared of a turn: its text and each call's tool and arguments (ids differ between runs)."""
    return {"text": text or None, "calls": [{"name": c.get("name"), "args": c.get("args") or {}} for c in calls]}


class _Pools:
    """The recording's tool results and decisions, served once each by tool and arguments."""

    def __init__(self, recording: Recording) -> None:
        self.results: dict[str, list[RecordedResult]] = defaultdict(list)
        self.decisions: dict[str, deque[RecordedDecision]] = defaultdict(deque)
        self.unrecorded: list[str] = []
        self.undecided: list[str] = []
        pending = [recording]
        while pending:
            current = pending.pop(0)
            for result in current.results:
                self.results[result.name].append(result)
            for decision in current.decisions:
                self.decisions[call_key(decision.tool_name or decision.kind, decision.args)].append(decision)
            pending.extend(current.children)

    def result_for(self, name: str, args: dict[str, Any]) -> RecordedResult | None:
        """The recorded result of this tool with these arguments; else its next one in recorded order.

        A ``pre_tool_call`` hook may have rewritten the arguments the recording kept (the model's).
        """
        found = self.results.get(name) or []
        for index, result in enumerate(found):
            if result.args == args:
                return found.pop(index)
        if found:
            return found.pop(0)
        self.unrecorded.append(call_key(name, args))
        return None

    def decide(self, approval: Approval) -> bool | str | None:
        queue = self.decisions.get(call_key(approval.tool_name or approval.kind, approval.args))
        if not queue:
            self.undecided.append(call_key(approval.tool_name or approval.kind, approval.args))
            return None
        decision = queue.popleft()
        if decision.answer is not None:
            return decision.answer
        return decision.status == "approved"


class _RecordedCallFailed(Exception):
    """A replayed call whose recorded result was an error: the model sees that error again."""


class _RecordedTool(Tool):
    """A tool that answers from the recording instead of running."""

    def __init__(self, original: Tool, pools: _Pools) -> None:  # a copy with another invoke
        self.__dict__.update(original.__dict__)
        self._pools = pools

    def invoke(self, args: dict[str, Any], context: ToolContext) -> Any:
        """The recorded result of this tool with these arguments."""
        self.validate(args)
        found = self._pools.result_for(self.name, args)
        if found is None:
            raise _RecordedCallFailed(f"the recording has no result for {self.name} with these arguments")
        if found.is_error:
            body = _json(found.content)
            raise _RecordedCallFailed(str(body.get("message") if isinstance(body, dict) else found.content))
        return found.content


def _json(text: Any) -> Any:
    try:
        return json.loads(text) if isinstance(text, str) else text
    except ValueError:
        return text


@contextlib.contextmanager
def _swapped(runtime: LocalRuntime, pools: _Pools, tools: str) -> Iterator[None]:
    """The runtime's agents with recorded tools for the block (``tools="recorded"``); put back after."""
    originals: list[tuple[Agent, dict[str, Tool]]] = []
    try:
        if tools == "recorded":
            for agent in runtime.agents.values():
                originals.append((agent, dict(agent.tools)))
                agent.tools.update({name: _RecordedTool(tool, pools) for name, tool in agent.tools.items()})
        yield
    finally:
        for agent, kept in originals:
            agent.tools.clear()
            agent.tools.update(kept)


class _Cassette:
    """Serves the recorded turns in order and keeps what each request asked."""

    def __init__(self, turns: list[RecordedTurn]) -> None:
        self.turns = turns
        self.requests: list[list[Message]] = []

    def __call__(self, messages: list[Message]) -> Any:
        self.requests.append(list(messages))
        index = sum(1 for m in messages if m.role == "assistant")
        if index >= len(self.turns):
            return {"error": "the recording has no more turns", "retryable": False}
        turn = self.turns[index]
        response: dict[str, Any] = {"text": turn.text or ""}
        if turn.tool_calls:
            response["tool_calls"] = [
                {"name": c.get("name"), "args": c.get("args") or {}, **({"id": c["id"]} if c.get("id") else {})}
                for c in turn.tool_calls
            ]
        if turn.usage.input_tokens or turn.usage.output_tokens:
            response["usage"] = {"input_tokens": turn.usage.input_tokens, "output_tokens": turn.usage.output_tokens}
        return response


def _asked(messages: list[Message]) -> list[dict[str, Any]]:
    """What is compared of a request's messages: role, text, calls (without ids)."""
    return [
        {
            "role": m.role,
            "content": redact(m.content) if isinstance(m.content, str) else m.content,
            "calls": [(c.name, c.args) for c in m.tool_calls or []],
        }
        for m in messages
        if m.role != "system"
    ]


def replay(
    recording: Recording | dict[str, Any] | str,
    agent: Agent,
    model: Literal["recorded"] | None = None,
    tools: Literal["recorded", "execute"] = "recorded",
    *,
    max_steps: int = 1000,
) -> ReplayReport:
    """Replay ``recording`` (a ``Recording``, its dict or its JSON) through ``agent``; see the module's text.

    Raises:
        ConfigurationError: the recording does not parse, is of another format, or is of another agent.
    """
    try:
        recorded = (
            Recording.model_validate_json(recording)
            if isinstance(recording, str)
            else Recording.model_validate(recording)
        )
    except ValueError as exc:
        raise errors.ConfigurationError(f"not a recording: {str(exc)[:200]}") from None
    if recorded.agent != agent.name:
        raise errors.ConfigurationError(f"the recording is of agent {recorded.agent!r}, not {agent.name!r}")
    if tools not in ("recorded", "execute") or model not in (None, "recorded"):
        raise errors.ConfigurationError('replay takes model=None or "recorded", tools="recorded" or "execute"')
    pools = _Pools(recorded)
    runtime = LocalRuntime.serving([agent])
    cassette = _Cassette(recorded.turns) if model == "recorded" else None
    own_model = agent.model
    try:
        if cassette is not None:
            agent.model = MockModel(cassette, model_id="recorded")
        with _swapped(runtime, pools, tools):
            for messages in recorded.inputs:
                runtime.send(recorded.session_id, agent.name, [m.dump() for m in messages])
                if runtime.settle(recorded.session_id, pools.decide, max_steps).finish_reason == "awaiting-approval":
                    break  # a decision the recording does not have: the rest cannot be replayed
    finally:
        agent.model = own_model
    replayed = [
        (int(e.data.get("step") or 0), _turn(e.data.get("text"), e.data.get("tool_calls") or []))
        for e in runtime.events(recorded.session_id)
        if e.type == "step.done"
    ]
    recorded_turns = [(t.step, _turn(t.text, t.tool_calls)) for t in recorded.turns]
    requests = _request_changes(recorded, agent, cassette) if cassette is not None else []
    diverged_at, diffs = _compare(recorded_turns, replayed)
    if requests and diverged_at is None:
        diverged_at = recorded_turns[0][0] if recorded_turns else 0
        diffs = [TurnDiff(step=s, recorded=t, replayed=t) for s, t in recorded_turns]
    return ReplayReport(
        diverged_at=diverged_at,
        turns=diffs,
        requests=requests,
        unrecorded_calls=pools.unrecorded,
        undecided=pools.undecided,
        result=RunResult.of(runtime.checkpoint(recorded.session_id)),
        recorded_finish_reason=recorded.finish_reason,
    )


def _compare(
    recorded: list[tuple[int, dict[str, Any]]], replayed: list[tuple[int, dict[str, Any]]]
) -> tuple[int | None, list[TurnDiff]]:
    """The first step where the turns differ (None: never), and every turn from there, side by side."""
    for index in range(max(len(recorded), len(replayed))):
        mine = recorded[index][1] if index < len(recorded) else None
        theirs = replayed[index][1] if index < len(replayed) else None
        if mine != theirs:
            step = recorded[index][0] if index < len(recorded) else replayed[index][0]
            diffs = [
                TurnDiff(
                    step=recorded[i][0] if i < len(recorded) else replayed[i][0],
                    recorded=recorded[i][1] if i < len(recorded) else None,
                    replayed=replayed[i][1] if i < len(replayed) else None,
                )
                for i in range(index, max(len(recorded), len(replayed)))
            ]
            return step, diffs
    return None, [TurnDiff(step=s, recorded=t, replayed=t) for s, t in recorded]


def _request_changes(recorded: Recording, agent: Agent, cassette: _Cassette) -> list[str]:
    """How what the agent asked the model differs from what the recorded run asked."""
    changes = []
    then = recorded.fingerprint or {}
    now = agent.fingerprint()
    if then and then.get("instructions") != now.get("instructions"):
        changes.append("the instructions changed")
    for name in sorted(set(then.get("tools") or {}) | set(now.get("tools") or {})):
        before, after = (then.get("tools") or {}).get(name), (now.get("tools") or {}).get(name)
        if before != after:
            changes.append(f"tool {name}: " + ("added" if before is None else "removed" if after is None else "schema"))
    for index, asked in enumerate(cassette.requests):
        expected = _asked(recorded.requests[index]) if index < len(recorded.requests) else None
        if expected is not None and _asked(asked) != expected:
            changes.append(f"the messages of the request for turn {index + 1} differ")
            break
    return changes
