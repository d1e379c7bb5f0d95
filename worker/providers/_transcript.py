"""Transcript pieces both wire formats share: content parts, tool-call argument JSON and call ids.

Pure functions over ``store.records`` values; no SDK, no I/O.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from store.records import Message

#: Raw argument text kept from a malformed call (the model sees it again, so it can correct it).
MAX_INVALID_ARGS_CHARS = 16_384

_WIRE_ID = re.compile(r"[A-Za-z0-9_-]{1,40}")


def text_part(text: str) -> dict[str, Any]:
    """One text part, in the shape both APIs use."""
    return {"type": "text", "text": text}


def content_parts(content: Any) -> list[dict[str, Any]]:
    """``content`` as a list of parts: text parts for strings, other dict parts as given."""
    if content is None:
        return []
    if isinstance(content, str):
        return [text_part(content)]
    if isinstance(content, list):
        parts: list[dict[str, Any]] = []
        for item in content:
            if isinstance(item, str):
                parts.append(text_part(item))
            elif isinstance(item, Mapping):
                parts.append(dict(item))
            else:
                parts.append(text_part(dumps(item)))
        return parts
    return [text_part(dumps(content))]


def content_text(content: Any) -> str:
    """All the text of ``content`` joined (non-text parts are left out)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(str(p.get("text", "")) for p in content_parts(content) if p.get("type") == "text")


def dumps(value: Any) -> str:
    """JSON text of ``value`` (non-JSON values as their ``str``)."""
    return json.dumps(value, ensure_ascii=False, default=str)


def parse_arguments(raw: Any) -> tuple[dict[str, Any], str | None]:
    """(args, invalid_args) of a tool call: a JSON object parses, anything else is kept as raw text.

    An empty or ``null`` argument string means no arguments; some servers send that for tools
    without parameters.
    """
    if isinstance(raw, Mapping):
        return dict(raw), None
    if raw is None:
        return {}, None
    text = raw if isinstance(raw, str) else dumps(raw)
    if not text.strip() or text.strip() == "null":
        return {}, None
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        return parsed, None
    return {}, text[:MAX_INVALID_ARGS_CHARS]


def arguments_text(args: Mapping[str, Any], invalid_args: str | None) -> str:
    """The argument text to send back for a stored call: the raw text when it was malformed."""
    return invalid_args if invalid_args is not None else dumps(dict(args))


def wire_call_id(call_id: str) -> str:
    """A call id both APIs accept (1-40 of ``A-Za-z0-9_-``); ids already valid pass unchanged.

    Others (from another provider, or hand-written) map to a stable hash, the same for the call
    and its result.
    """
    if _WIRE_ID.fullmatch(call_id):
        return call_id
    return "call_" + hashlib.sha256(call_id.encode()).hexdigest()[:32]


def assign_call_ids(given: Sequence[str | None], transcript: Sequence[Message]) -> list[str]:
    """Ids for a new turn's calls: the provider's, unless missing or already used in the run.

    Tools use the id as the idempotency key of their side effects, so a server that numbers calls
    ``call_0`` every turn must not make two different calls share one. Replacements are
    deterministic (``call_<turn>_<index>``), like ``MockModel``'s.
    """
    used = {c.id for m in transcript if m.role == "assistant" for c in m.tool_calls or ()}
    turn = sum(1 for m in transcript if m.role == "assistant")
    ids: list[str] = []
    for index, call_id in enumerate(given):
        chosen = call_id or ""
        if not chosen or chosen in used:
            chosen = f"call_{turn}_{index}"
            while chosen in used:
                chosen += "_"
        used.add(chosen)
        ids.append(chosen)
    return ids
