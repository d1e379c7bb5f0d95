r"""Make arbitrary values safe to store as Postgres JSON: no NUL, no NaN, valid Unicode, bounded size and depth.

Postgres refuses ``\\u0000`` and ``NaN`` in ``jsonb``, and a lone surrogate cannot be encoded as UTF-8;
a value carrying any of them would fail every save of its run forever (a poison pill), so every value
that reaches a checkpoint passes through here.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from store import errors, redaction

MAX_DEPTH = 32
MAX_INPUT_STRING = 1024 * 1024  # one input string (user message)
MAX_TOOL_RESULT = 256 * 1024  # one tool result's text, truncated past it
MAX_INPUT_TOTAL = 4 * 1024 * 1024  # everything one send carries, serialized
MAX_CHECKPOINT = 8 * 1024 * 1024  # one serialized checkpoint
REPLY_ROOM = 1024 * 1024  # kept free under MAX_CHECKPOINT when input is queued or merged
MAX_TURN_RESULTS = 2 * 1024 * 1024  # the results one tool batch appends, together
MAX_ERROR_TEXT = 2000  # an error message stored or shown to the model
MAX_TOOL_CALLS_PER_TURN = 64
MAX_INT_DIGITS = 1000
NUL_REPLACEMENT = "\ufffd"
TRUNCATION_MARK = "\n[truncated: {dropped} of {total} characters not kept]"


#: Code points that are only valid in pairs inside UTF-16; alone (``os.listdir`` with surrogateescape,
#: a model that split a pair) they cannot be encoded as UTF-8.
_SURROGATES = re.compile("[\ud800-\udfff]")


def clean_text(text: str) -> str:
    """Text that Postgres can store: every NUL and every lone surrogate replaced by U+FFFD."""
    if "\x00" in text:
        text = text.replace("\x00", NUL_REPLACEMENT)
    if not text.isascii():
        text = _SURROGATES.sub(NUL_REPLACEMENT, text)
    return text


def clean_error(text: str) -> str:
    """An error message fit to store and to show a model: clean, secrets masked, size-capped."""
    return redaction.redact(clean_text(text))[:MAX_ERROR_TEXT]


def text_size(text: str) -> int:
    """Bytes of ``text`` as UTF-8 (cheap for ASCII)."""
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def fit_text(text: str, limit: int) -> str:
    """``text`` cut so it stays within ``limit`` UTF-8 bytes, marker included, when it is over."""
    size = text_size(text)
    if size <= limit:
        return text
    marker = TRUNCATION_MARK.format(dropped=len(text), total=len(text))  # the longest it can be
    keep = max(limit - text_size(marker), 0)
    head = text.encode("utf-8")[:keep].decode("utf-8", errors="ignore")
    return head + TRUNCATION_MARK.format(dropped=len(text) - len(head), total=len(text))


def truncate_text(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters with a marker saying how much was dropped."""
    if len(text) <= limit:
        return text
    return text[:limit] + TRUNCATION_MARK.format(dropped=len(text) - limit, total=len(text))


def sanitize(value: Any, *, depth: int = 0) -> Any:
    """A JSON-safe copy of ``value``: NUL replaced, NaN/Infinity as strings, deep parts as text.

    Unknown objects become their ``str()``; nothing raises, so a tool's odd output can always be
    recorded as its result.
    """
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, int):
        return value if abs(value).bit_length() < MAX_INT_DIGITS * 3 else _huge_int_text(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if depth >= MAX_DEPTH:
        return clean_text(_shallow_repr(value))
    if isinstance(value, dict):
        return {_key_text(k): sanitize(v, depth=depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [sanitize(v, depth=depth + 1) for v in value]
    if hasattr(value, "model_dump"):
        return sanitize(value.model_dump(mode="json"), depth=depth)
    return clean_text(str(value))


def _key_text(key: Any) -> str:
    if isinstance(key, int):
        return str(sanitize(key))
    return clean_text(str(key))


def _huge_int_text(value: int) -> str:
    try:
        return str(value)[:MAX_INT_DIGITS]
    except ValueError:  # past Python's int-to-str digit limit (4300 by default) str() raises
        return f"<integer of {abs(value).bit_length()} bits>"


def _shallow_repr(value: Any) -> str:
    try:
        return repr(value)[:1000]
    except RecursionError:
        return "<too deeply nested>"
    except ValueError:  # an int past the digit limit somewhere inside
        return f"<{type(value).__name__} that cannot be shown>"


def dumps(value: Any) -> str:
    """Strict JSON text (NaN refused) of an already sanitized value."""
    return json.dumps(value, allow_nan=False, ensure_ascii=False, separators=(",", ":"))


def _refuse_constant(name: str) -> Any:
    raise errors.InputTooLargeError(f"JSON constant {name} is not accepted")


def loads_untrusted(text: str | bytes) -> Any:
    """Parse JSON from outside: NaN/Infinity refused, depth capped, no RecursionError escapes.

    Raises:
        InputTooLargeError: the document is too deep, has a refused constant or is not JSON.
    """
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError as exc:
        raise errors.InputTooLargeError("JSON nested too deeply") from exc
    except ValueError as exc:
        raise errors.InputTooLargeError(f"not valid JSON: {str(exc)[:200]}") from exc
    check_depth(value)
    return value


def check_depth(value: Any, limit: int = MAX_DEPTH) -> None:
    """Raise ``InputTooLargeError`` when ``value`` nests deeper than ``limit`` (iteratively)."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            raise errors.InputTooLargeError(f"input nested deeper than {limit} levels")
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list | tuple):
            stack.extend((v, depth + 1) for v in item)


def tool_result_text(value: Any) -> str:
    """The text a tool message carries for a tool's return value, sanitized and size-capped."""
    if isinstance(value, str):
        text = clean_text(value)
    else:
        text = dumps(sanitize(value))
    return truncate_text(text, MAX_TOOL_RESULT)
