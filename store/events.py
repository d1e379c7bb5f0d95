"""A run's durable events: what each save makes true, numbered without gaps, and read back by consumers.

Every run (session id) has one ordered log in ``run_events``: ``seq`` starts at 0 and grows across every
input of the session, never reused while the run exists. Events are written by the save that makes them
true, in the same statement (``SAVE_EVENTS``), so a crash keeps them exactly when it keeps the save; a
fenced-out save writes none. An event about a transcript entry (a model turn, a tool result) points at its
``run_messages`` row by slot instead of holding a second copy; readers join the row back in.

Live signals (``LIVE``) are never stored: steps publish them on the run's Redis channel while a consumer
watches (``store.signals``), and a crash loses them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict

from store import payloads
from store.records import EventDraft, Message

__all__ = ["DURABLE", "EVENT_VERSION", "LIVE", "Event", "encode"]

#: Version of the event envelope; new types and fields are additive, a breaking change bumps it.
EVENT_VERSION = 1
#: Types a save writes (numbered, kept as long as the run).
DURABLE = frozenset(
    {
        "run.start",
        "step.done",
        "tool.done",
        "tool.error",
        "tool.reconcile",
        "approval.requested",
        "agent.drift",
        "provider.retry",
        "error",
        "run.done",
    }
)
#: Types published only while a consumer listens (no seq, lost on a crash).
LIVE = frozenset({"step.start", "tool.start", "text.delta", "tool.partial"})


class Event(BaseModel):
    """One event of a run: durable (``seq`` set) or a live signal (``seq`` None)."""

    model_config = ConfigDict(frozen=True)

    run_id: str
    seq: int | None
    type: str
    at: datetime
    v: int = EVENT_VERSION
    data: dict[str, Any]

    @property
    def durable(self) -> bool:
        """Whether the event is stored (it has a seq)."""
        return self.seq is not None

    def wire(self) -> dict[str, Any]:
        """The event as JSON-safe data (the SSE ``data`` and ``--json`` lines)."""
        return self.model_dump(mode="json")


def encode(drafts: Sequence[EventDraft], slot_of: Callable[[Message], int | None]) -> str:
    """``drafts`` as the JSON array a save stores: ``[[type, slot or null, data], ...]``.

    A draft's message is stored by reference (``slot_of`` finds the row the same save writes); one whose
    row cannot be found is kept whole in the data instead.
    """
    body = []
    for draft in drafts:
        data = dict(draft.data)
        slot = None
        if draft.message is not None:
            slot = slot_of(draft.message)
            if slot is None:
                data["message"] = draft.message.dump()
        body.append([draft.type, slot, data])
    return payloads.dumps(body)


#: Event types about a transcript entry (their data points at a ``run_messages`` row, or holds it whole).
_ABOUT_A_MESSAGE = frozenset({"step.done", "tool.done", "tool.error"})


def with_message(event_type: str, data: dict[str, Any], message: dict[str, Any] | None) -> dict[str, Any]:
    """An event's data with the transcript entry it points at folded in.

    Only events about a transcript entry have one: an ``error`` event's ``message`` is its text, kept as it is.
    """
    if event_type not in _ABOUT_A_MESSAGE:
        return data
    if message is None and isinstance(data.get("message"), dict):
        message = data.pop("message")  # kept whole by ``encode`` when its row could not be found
    if message is None:
        return data
    if event_type == "step.done":
        calls = [
            {"id": c.get("id"), "name": c.get("name"), "args": c.get("args") or {}}
            for c in message.get("tool_calls") or ()
        ]
        return {**data, "text": message.get("content"), "tool_calls": calls}
    if event_type in ("tool.done", "tool.error"):
        result = message.get("content")
        merged = {
            **data,
            "tool_call_id": message.get("tool_call_id"),
            "tool_name": message.get("name"),
            "result": result,
        }
        if message.get("replaced_by_hook"):
            merged["replaced_by_hook"] = True
        if event_type == "tool.error" and isinstance(result, str):
            try:
                body = json.loads(result)
            except ValueError:
                body = None
            if isinstance(body, dict):
                merged.setdefault("kind", body.get("kind"))
                merged["error"] = body
        return merged
    return data


def from_rows(run_id: str, rows: Iterable[Any]) -> list[Event]:
    """Events from rows of ``READ`` (seq, type, at, data, message)."""
    return [
        Event(
            run_id=run_id,
            seq=int(row.seq),
            type=row.type,
            at=row.at,
            data=with_message(row.type, dict(row.data or {}), row.message),
        )
        for row in rows
    ]


def live(run_id: str, event_type: str, data: dict[str, Any], at: datetime) -> Event:
    """A live signal (no seq)."""
    return Event(run_id=run_id, seq=None, type=event_type, at=at, data=data)
