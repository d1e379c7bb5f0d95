"""How history entries are stored so that a long run's history grows linearly, not with its square.

Within a run a transcript only changes at its tail, so an entry stores the messages it shares with
the entry before it as a count (``keep``) and only the rest as ``tail``. Every ``KEYFRAME_EVERY``
saves (and whenever the previous entry is not known) an entry stores the whole transcript
(``keep = 0``), and the ring is trimmed at a keyframe so every kept entry can be rebuilt.
Rows written before this format (a full ``messages`` list) read as keyframes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from store.records import Message

KEYFRAME_EVERY = 16


def shared_prefix(before: Sequence[Message], after: Sequence[Message]) -> int:
    """How many leading messages ``after`` shares with ``before`` (identity first: saves share objects)."""
    limit = min(len(before), len(after))
    index = 0
    while index < limit and (before[index] is after[index] or before[index] == after[index]):
        index += 1
    return index


def entry_document(document: dict[str, Any], keep: int) -> dict[str, Any]:
    """The history form of a checkpoint document: its first ``keep`` messages left out."""
    if keep <= 0:
        return document
    entry = {k: v for k, v in document.items() if k != "messages"}
    entry["messages_keep"] = keep
    entry["messages_tail"] = list(document.get("messages") or [])[keep:]
    return entry


def is_keyframe(document: dict[str, Any]) -> bool:
    """Whether an entry holds its whole transcript."""
    return "messages_keep" not in document


def expand(rows: Iterable[tuple[int, dict[str, Any]]]) -> list[tuple[int, dict[str, Any]]]:
    """Rebuild full documents from ``(seq, document)`` rows in ascending seq order.

    A delta whose base entry is missing (trimmed or never written) cannot be rebuilt and is left out.
    """
    rebuilt: list[tuple[int, dict[str, Any]]] = []
    previous: tuple[int, list[Any]] | None = None
    for seq, document in rows:
        if is_keyframe(document):
            messages = list(document.get("messages") or [])
            rebuilt.append((seq, document))
        elif previous is not None and previous[0] == seq - 1 and len(previous[1]) >= document["messages_keep"]:
            messages = previous[1][:document["messages_keep"]] + list(document.get("messages_tail") or [])
            full = {k: v for k, v in document.items() if k not in ("messages_keep", "messages_tail")}
            full["messages"] = messages
            rebuilt.append((seq, full))
        else:
            previous = None
            continue
        previous = (seq, messages)
    return rebuilt
