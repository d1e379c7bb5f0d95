"""Compare two runs step by step: where they diverge and how (tool order, arguments, length, ending).

Steps are numbered from 1, one per model turn, as a run's history numbers them: ``diverged_at`` is the history step
whose save holds the first differing turn, so ``fork(from_step=diff.diverged_at)`` starts from that turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from store.records import Checkpoint, Message


@dataclass(frozen=True)
class TrajectoryStep:
    """One assistant turn: its text and its tool calls with their results."""

    text: str | None
    tool_calls: list[dict[str, Any]]

    def key(self) -> tuple[Any, ...]:
        """What counts when comparing steps (tool call ids aside)."""
        return self.text, tuple((c["name"], repr(sorted(c["args"].items())), c["result"]) for c in self.tool_calls)


@dataclass(frozen=True)
class Drift:
    """Differences between two trajectories."""

    tool_order: list[dict[str, Any]] = field(default_factory=list)
    arguments: list[dict[str, Any]] = field(default_factory=list)
    step_count: dict[str, int] | None = None
    finish_reason: dict[str, str | None] | None = None


@dataclass(frozen=True)
class TrajectoryComparison:
    """``diverged_at`` is the first differing step, numbered from 1 as history steps are (None when identical)."""

    diverged_at: int | None
    a: list[TrajectoryStep]
    b: list[TrajectoryStep]
    drift: Drift


def _transcript(value: Checkpoint | Sequence[Message | dict[str, Any]]) -> list[Message]:
    if isinstance(value, Checkpoint):
        return list(value.messages)
    return [m if isinstance(m, Message) else Message.model_validate(m) for m in value]


def steps_of(messages: Sequence[Message]) -> list[TrajectoryStep]:
    """One step per assistant turn, each call with the content of its result (None if missing)."""
    results = {m.tool_call_id: m.content for m in messages if m.role == "tool"}
    steps = []
    for message in messages:
        if message.role != "assistant":
            continue
        calls = [
            {"id": c.id, "name": c.name, "args": c.args, "result": results.get(c.id)} for c in message.tool_calls or ()
        ]
        steps.append(
            TrajectoryStep(text=message.content if isinstance(message.content, str) else None, tool_calls=calls)
        )
    return steps


def compare_trajectories(
    a: Checkpoint | Sequence[Message | dict[str, Any]], b: Checkpoint | Sequence[Message | dict[str, Any]]
) -> TrajectoryComparison:
    """Compare two checkpoints or transcripts; steps (``diverged_at``, ``drift``) are numbered from 1."""
    steps_a, steps_b = steps_of(_transcript(a)), steps_of(_transcript(b))
    diverged_at = next(
        (step for step, (x, y) in enumerate(zip(steps_a, steps_b, strict=False), start=1) if x.key() != y.key()), None
    )
    if diverged_at is None and len(steps_a) != len(steps_b):
        diverged_at = min(len(steps_a), len(steps_b)) + 1
    tool_order, arguments = [], []
    for index, (x, y) in enumerate(zip(steps_a, steps_b, strict=False), start=1):
        names_a, names_b = [c["name"] for c in x.tool_calls], [c["name"] for c in y.tool_calls]
        if names_a != names_b:
            tool_order.append({"step": index, "a": names_a, "b": names_b})
            continue
        for call_a, call_b in zip(x.tool_calls, y.tool_calls, strict=True):
            if call_a["args"] != call_b["args"]:
                arguments.append({"step": index, "tool": call_a["name"], "a": call_a["args"], "b": call_b["args"]})
    finish: dict[str, str | None] | None = None
    if isinstance(a, Checkpoint) and isinstance(b, Checkpoint) and a.finish_reason != b.finish_reason:
        finish = {"a": a.finish_reason, "b": b.finish_reason}
    count = {"a": len(steps_a), "b": len(steps_b)} if len(steps_a) != len(steps_b) else None
    return TrajectoryComparison(
        diverged_at,
        steps_a,
        steps_b,
        Drift(tool_order=tool_order, arguments=arguments, step_count=count, finish_reason=finish),
    )
