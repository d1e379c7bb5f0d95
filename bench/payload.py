"""The tool results of ``--result-bytes``: deterministic ASCII text of a given size, the same in every system.

Pure functions on a block of words built once per process; it knows nothing of Celery, Lousho or DBOS.
"""

from __future__ import annotations

import random

_WORDS = (
    "the",
    "run",
    "step",
    "tool",
    "result",
    "file",
    "line",
    "error",
    "value",
    "search",
    "found",
    "match",
    "def",
    "return",
    "import",
    "class",
    "data",
    "page",
    "query",
    "status",
    "ok",
    "test",
    "passed",
    "failed",
    "config",
    "path",
    "node",
    "token",
    "model",
    "output",
    "input",
    "cache",
    "index",
    "table",
    "row",
    "text",
)
_BLOCK_BYTES = 1 << 16
_block: list[str] = []


def _text_block() -> str:
    """64 KiB of words from a seeded generator: compresses like prose, not like one repeated word."""
    if not _block:
        rng = random.Random(12)
        words: list[str] = []
        size = 0
        while size < _BLOCK_BYTES:
            word = rng.choice(_WORDS) + ("\n" if rng.random() < 0.1 else " ")
            words.append(word)
            size += len(word)
        _block.append("".join(words)[:_BLOCK_BYTES])
    return _block[0]


def result_text(size: int, position: int) -> str:
    """``size`` bytes of text (ASCII), a function of ``size`` and ``position`` only; ``"ok"`` when ``size`` is 0.

    Different positions start at different offsets of the block, so consecutive results differ.
    """
    if size <= 0:
        return "ok"
    block = _text_block()
    start = (position * 7919) % _BLOCK_BYTES
    text = block[start : start + size]
    while len(text) < size:
        text += block[: size - len(text)]
    return text
