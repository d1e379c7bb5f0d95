"""A run written down for replay: its inputs, model turns with usage, tool results, decisions and child runs.

``Client.export`` builds one from what is stored (the run's events, inbox and approvals) and ``worker.testing.replay``
runs it through an agent again. Secret-shaped text (``store.redaction``) is masked on the way out. Pure: records and
the rules that build them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from store.events import Event
from store.records import Approval, Message, Usage
from store.redaction import redact

__all__ = [
    "FORMAT",
    "RecordedDecision",
    "RecordedResult",
    "RecordedTurn",
    "Recording",
    "approval_ids",
    "build",
    "call_key",
    "inputs_of",
]

#: The recording format this release writes and reads.
FORMAT = "lousho-recording/1"


class _Recorded(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class RecordedTurn(_Recorded):
    """One model turn: the step that saved it (history numbering), its text and calls, its usage."""

    step: int
    text: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    usage: Usage = Field(default_factory=Usage)


class RecordedResult(_Recorded):
    """One tool call's result as the model saw it."""

    tool_call_id: str
    name: str
    args: dict[str, Any] = Field(default_factory=dict)
    content: Any = None
    is_error: bool = False


class RecordedDecision(_Recorded):
    """One decision of a person: on a gated call (``kind`` tool), a question or a reconciliation."""

    kind: str
    tool_name: str | None = None
    args: dict[str, Any] = Field(default_factory=dict)
    status: str
    answer: str | None = None
    note: str | None = None


class Recording(_Recorded):
    """A run as ``lousho export`` writes it (JSON); ``children`` are the runs its sub-agent calls started."""

    format: str = FORMAT
    session_id: str
    agent: str
    inputs: list[list[Message]]
    turns: list[RecordedTurn]
    results: list[RecordedResult]
    decisions: list[RecordedDecision]
    finish_reason: str | None = None
    text: str | None = None
    usage: Usage = Field(default_factory=Usage)
    #: The agent's fingerprint when the run last saved (model id, hashes of the instructions and tool schemas).
    fingerprint: dict[str, Any] | None = None
    #: The run's transcript, as the model was last asked (masked).
    messages: list[Message] = Field(default_factory=list)
    children: list[Recording] = Field(default_factory=list)

    @property
    def requests(self) -> list[list[Message]]:
        """The messages each model turn was asked with: the transcript before each of its assistant messages."""
        return [self.messages[:index] for index, m in enumerate(self.messages) if m.role == "assistant"]


def call_key(name: str, args: dict[str, Any]) -> str:
    """How a recorded call is found again: its tool's name and its arguments, canonical."""
    return f"{name}:{json.dumps(args, sort_keys=True, default=str)}"


def _masked(value: Any) -> Any:
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {key: _masked(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_masked(item) for item in value]
    return value


def _message(message: Message) -> Message:
    return message.model_copy(update={"content": _masked(message.content)})


def inputs_of(messages: Sequence[Message]) -> list[list[Message]]:
    """The inputs a transcript holds: each run of user messages between model turns is one."""
    found: list[list[Message]] = []
    previous = None
    for message in messages:
        if message.role == "user":
            if previous != "user":
                found.append([])
            found[-1].append(_message(message))
        previous = message.role
    return found


def approval_ids(events: Iterable[Event]) -> list[str]:
    """The approvals a run's events say it asked for, in order."""
    return [str(e.data["approval_id"]) for e in events if e.type == "approval.requested" and e.data.get("approval_id")]


def build(
    session_id: str,
    agent: str,
    events: Sequence[Event],
    messages: Sequence[Message],
    approvals: Iterable[Approval],
    children: Sequence[Recording] = (),
    fingerprint: dict[str, Any] | None = None,
) -> Recording:
    """The recording of run ``session_id`` from its durable events, its transcript and its approvals (any order)."""
    turns: list[RecordedTurn] = []
    results: list[RecordedResult] = []
    calls: dict[str, dict[str, Any]] = {}
    finish_reason, text, usage = None, None, Usage()
    for event in events:
        data = event.data
        if event.type == "step.done":
            tool_calls = [
                {"id": call.get("id"), "name": call.get("name"), "args": _masked(call.get("args") or {})}
                for call in data.get("tool_calls") or []
            ]
            calls.update({str(call["id"]): call for call in tool_calls})
            turns.append(
                RecordedTurn(
                    step=int(data.get("step") or 0),
                    text=_masked(data.get("text")),
                    tool_calls=tool_calls,
                    usage=Usage.model_validate(data.get("usage") or {}),
                )
            )
        elif event.type in ("tool.done", "tool.error"):
            call_id = str(data.get("tool_call_id") or "")
            call = calls.get(call_id, {})
            results.append(
                RecordedResult(
                    tool_call_id=call_id,
                    name=str(data.get("tool_name") or call.get("name") or ""),
                    args=call.get("args") or {},
                    content=_masked(data.get("result")),
                    is_error=event.type == "tool.error",
                )
            )
        elif event.type == "run.done":
            finish_reason = data.get("finish_reason")
            text = _masked(data.get("text"))
            usage = Usage.model_validate(data.get("usage") or {})
    decisions = [
        RecordedDecision(
            kind=approval.kind,
            tool_name=approval.tool_name,
            args=_masked(approval.args),
            status=approval.status,
            answer=_masked(approval.answer),
            note=_masked(approval.note),
        )
        for approval in sorted(approvals, key=lambda a: (str(a.created_at), a.approval_id))
        if approval.status in ("approved", "rejected")
    ]
    return Recording(
        session_id=session_id,
        agent=agent,
        inputs=inputs_of(messages),
        turns=turns,
        results=results,
        decisions=decisions,
        finish_reason=finish_reason,
        text=text,
        usage=usage,
        fingerprint=fingerprint,
        messages=[_message(m) for m in messages],
        children=list(children),
    )
