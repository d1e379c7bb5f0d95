"""The benchmark's agent: a scripted model that calls a no-op tool, so every step is pure overhead.

A run's input is ``"bench <turns>"``. The model answers its first ``<turns>`` turns with one call
to ``noop`` and then a final text, so a run takes ``2 * turns + 1`` steps: model turn, tool batch,
model turn, ..., final model turn. Each step is one task and one saved checkpoint. The turn count
travels in the input, so runs of any length share the same worker processes.

``bench-usage`` is the same agent with a model that reports its token usage the way the real
providers do, so each model turn also pays the usage note a real provider's turn pays before its
save (``MockModel`` reports none).

Workers load this module through ``LOUSHO_AGENTS=bench.agents``; importing it also installs the
in-task timing hook of ``bench.timing`` when ``BENCH_TIMINGS`` is set.
"""

from __future__ import annotations

from typing import Any

from bench import timing
from store.records import Message
from worker import Agent, ToolContext, tool
from worker.providers import MockModel

AGENT = "bench"
USAGE_AGENT = "bench-usage"
PREFIX = "bench "


def input_for(hops: int) -> str:
    """The input that makes a run take ``hops`` steps (rounded up to an odd number)."""
    return f"{PREFIX}{turns_for(hops)}"


def turns_for(hops: int) -> int:
    """Tool-calling model turns of a run of ``hops`` steps."""
    return max(hops, 1) // 2


def steps_for(hops: int) -> int:
    """Steps a run asked for ``hops`` really takes: every tool turn is two steps, plus the final turn."""
    return 2 * turns_for(hops) + 1


def _turns(messages: list[Message]) -> int:
    for message in messages:
        if message.role == "user" and isinstance(message.content, str) and message.content.startswith(PREFIX):
            return int(message.content[len(PREFIX):].split()[0])
    return 0


def _script(messages: list[Message]) -> Any:
    done = sum(1 for m in messages if m.role == "assistant")
    if done < _turns(messages):
        return {"tool_calls": [{"name": "noop", "args": {}}], "usage": {"input_tokens": 1, "output_tokens": 1}}
    return {"text": "done", "usage": {"input_tokens": 1, "output_tokens": 1}}


@tool
def noop(ctx: ToolContext) -> str:
    """Do nothing."""
    return "ok"


class _UsageReportingModel(MockModel):
    """The scripted model, reporting usage like a real provider."""

    reports_usage = True


bench = Agent(name=AGENT, model=MockModel(_script, model_id="bench-mock"), instructions="",
              tools=[noop], max_steps=100_000, tool_concurrency=1)
bench_usage = Agent(name=USAGE_AGENT, model=_UsageReportingModel(_script, model_id="bench-mock"), instructions="",
                    tools=[noop], max_steps=100_000, tool_concurrency=1)

timing.install()
