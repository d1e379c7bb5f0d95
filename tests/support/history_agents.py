"""The agent the recorded histories were made with (kept stable: the fixtures depend on it)."""

from __future__ import annotations

from worker import Agent, ToolContext, tool
from worker.providers import MockModel

effects: list[str] = []


@tool
def lookup(city: str, ctx: ToolContext) -> str:
    """Weather of a city."""
    effects.append(ctx.tool_call_id)
    return f"sunny in {city}"


@tool(needs_approval=True)
def book(city: str) -> str:
    """Book a trip."""
    effects.append(f"book {city}")
    return f"booked {city}"


def travel_agent() -> Agent:
    """Two lookups, then a gated booking, then a final answer."""
    return Agent(
        name="travel",
        model=MockModel(
            [
                {
                    "tool_calls": [
                        {"name": "lookup", "args": {"city": "Oslo"}},
                        {"name": "lookup", "args": {"city": "Rome"}},
                    ]
                },
                {"tool_calls": [{"name": "book", "args": {"city": "Rome"}}]},
                "Booked Rome: sunny there.",
            ]
        ),
        instructions="Plan trips.",
        tools=[lookup, book],
    )
