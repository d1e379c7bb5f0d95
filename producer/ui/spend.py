"""What a run spent, as its page shows it: its tokens, and the cost its workers recorded for each model turn.

The cost comes only from ``step.done`` events (``cost``, written by a worker whose agent has prices): the pages
never import an agent to price usage themselves. It reads and writes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from store.events import Event
from store.records import Usage


@dataclass(frozen=True)
class Spend:
    """A run's tokens and, when its workers recorded any, the cost of its turns (``priced`` of ``turns``)."""

    usage: Usage
    cost: float | None
    priced: int
    turns: int

    @property
    def cost_text(self) -> str:
        """The cost for people: six decimals at most, no trailing zeros."""
        return "" if self.cost is None else f"{self.cost:.6f}".rstrip("0").rstrip(".")


def spend(usage: Usage, run_events: Sequence[Event]) -> Spend:
    """The run's ``usage`` and the sum of the costs its ``step.done`` events recorded (None when none did)."""
    turns = [event for event in run_events if event.type == "step.done"]
    costs = [
        float(c)
        for c in (event.data.get("cost") for event in turns)
        if isinstance(c, (int, float)) and not isinstance(c, bool)
    ]
    return Spend(usage, sum(costs) if costs else None, len(costs), len(turns))


__all__ = ["Spend", "spend"]
