"""The benchmark's agent: a scripted model that calls a no-op tool, so every step is pure overhead.

A run's input is ``"bench <turns> <bytes>"``. The model answers its first ``<turns>`` turns with one
call to ``noop`` and then a final text, so a run takes ``2 * turns + 1`` steps: model turn, tool batch,
model turn, ..., final model turn. Each step is one task and one saved checkpoint. ``noop`` returns
``<bytes>`` bytes of text (``bench.payload``; ``"ok"`` for 0), so the transcript grows like a real one.
Both numbers travel in the input, so runs of any length and size share the same worker processes.

``bench-usage`` is the same agent with a model that reports its token usage the way the real
providers do, so each model turn also pays the usage note a real provider's turn pays before its
save (``MockModel`` reports none).

Workers load this module through ``LOUSHO_AGENTS=bench.agents``; importing it also installs the
in-task timing hook of ``bench.timing`` when ``BENCH_TIMINGS`` is set.
"""

from __future__ import annotations

from typing import Any

from bench import payload, timing
from store.records import Message
from worker import Agent, ToolContext, tool
from worker.providers import MockModel

AGENT = "bench"
USAGE_AGENT = "bench-usage"
PREFIX = "bench "


def input_for(hops: int, result_bytes: int = 0) -> str:
    """The input that makes a run take ``hops`` steps (rounded up to odd), its tool returning ``result_bytes``."""
    return f"{PREFIX}{turns_for(hops)} {max(result_bytes, 0)}"


def turns_for(hops: int) -> int:
    """Tool-calling model turns of a run of ``hops`` steps."""
    return max(hops, 1) // 2


def steps_for(hops: int) -> int:
    """Steps a run asked for ``hops`` really takes: every tool turn is two steps, plus the final turn."""
    return 2 * turns_for(hops) + 1


def _request(messages: list[Message]) -> tuple[int, int]:
    """The run's tool-calling turns and result size, from its first ``bench`` input (0, 0 when none)."""
    for message in messages:
        if message.role == "user" and isinstance(message.content, str) and message.content.startswith(PREFIX):
            words = message.content[len(PREFIX) :].split()
            return int(words[0]), int(words[1]) if len(words) > 1 else 0
    return 0, 0


def _script(messages: list[Message]) -> Any:
    done = sum(1 for m in messages if m.role == "assistant")
    turns, size = _request(messages)
    if done < turns:
        args = {"size": size, "position": done} if size else {}
        return {"tool_calls": [{"name": "noop", "args": args}], "usage": {"input_tokens": 1, "output_tokens": 1}}
    return {"text": "done", "usage": {"input_tokens": 1, "output_tokens": 1}}


@tool
def noop(ctx: ToolContext, size: int = 0, position: int = 0) -> str:
    """Return ``size`` bytes of text (``"ok"`` for 0), nothing else."""
    return payload.result_text(size, position)


class _UsageReportingModel(MockModel):
    """The scripted model, reporting usage like a real provider."""

    reports_usage = True


bench = Agent(
    name=AGENT,
    model=MockModel(_script, model_id="bench-mock"),
    instructions="",
    tools=[noop],
    max_steps=100_000,
    tool_concurrency=1,
)
bench_usage = Agent(
    name=USAGE_AGENT,
    model=_UsageReportingModel(_script, model_id="bench-mock"),
    instructions="",
    tools=[noop],
    max_steps=100_000,
    tool_concurrency=1,
)

timing.install()
