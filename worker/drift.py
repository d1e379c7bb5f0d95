"""Agent drift: what changed between the agent that saved a checkpoint and the one resuming it.

Fingerprints hold the model id, a hash per tool input schema and a hash of the instructions;
code-only changes (a tool's body, hooks) never count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class AgentDrift:
    """What changed in an agent since it saved a run, part by part (``compare_trajectories`` compares runs)."""

    model: tuple[str, str] | None = None
    tools_added: list[str] = field(default_factory=list)
    tools_removed: list[str] = field(default_factory=list)
    tools_changed: list[str] = field(default_factory=list)
    instructions: bool = False

    def describe(self) -> str:
        """One line naming what changed (no prompt text)."""
        parts = []
        if self.model:
            parts.append(f"model {self.model[0]} -> {self.model[1]}")
        if self.tools_added:
            parts.append(f"tools added {', '.join(self.tools_added)}")
        if self.tools_removed:
            parts.append(f"tools removed {', '.join(self.tools_removed)}")
        if self.tools_changed:
            parts.append(f"tool schemas changed {', '.join(self.tools_changed)}")
        if self.instructions:
            parts.append("instructions changed")
        return "; ".join(parts) or "fingerprint changed"

    def as_event(self) -> dict[str, Any]:
        """The drift event's fields."""
        return {
            "model": list(self.model) if self.model else None,
            "tools_added": self.tools_added,
            "tools_removed": self.tools_removed,
            "tools_changed": self.tools_changed,
            "instructions": self.instructions,
        }


def compare(saved: dict[str, Any] | None, current: dict[str, Any]) -> AgentDrift | None:
    """The drift from ``saved`` to ``current``; None when equal or when nothing was saved."""
    if not saved or saved.get("hash") == current.get("hash"):
        return None
    old_tools: dict[str, str] = dict(saved.get("tools") or {})
    new_tools: dict[str, str] = dict(current.get("tools") or {})
    model = None
    if saved.get("model") != current.get("model"):
        model = (str(saved.get("model")), str(current.get("model")))
    drift = AgentDrift(
        model=model,
        tools_added=sorted(set(new_tools) - set(old_tools)),
        tools_removed=sorted(set(old_tools) - set(new_tools)),
        tools_changed=sorted(n for n in set(old_tools) & set(new_tools) if old_tools[n] != new_tools[n]),
        instructions=saved.get("instructions") != current.get("instructions"),
    )
    return drift if drift.describe() != "fingerprint changed" else None
