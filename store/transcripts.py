"""A run's transcript as append-only rows: slots, what a save adds, and what a process already read.

Since checkpoint format 2 every message of a run is a row of ``run_messages`` keyed by ``(session_id, slot)``
and stamped with the ``seq`` of the save that wrote it; the run's document holds everything else. A step
writes only the rows it adds, so a save costs what the step added, not what the run holds.

A message's slot is its position in the finished transcript. Results of the last turn settle in any order
and are kept in call order, so while some are missing a result's slot is the turn's slot plus one plus its
call's position; once every result is in, every slot equals the message's index. Rows are never rewritten by
a step: a save that changes stored messages (a store used directly, never the step machine) rewrites them
and renews the run's ``transcript_id``, which tells every process that what it remembers is void.

``Transcripts`` is what one process remembers of the runs it stepped lately: the messages (already parsed),
their slots and byte sizes. A claim asks only for the rows past what it remembers, and a save diffs against
it; both fall back to reading the whole transcript when it does not know the run.
"""

from __future__ import annotations

import operator
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from store import payloads
from store.records import Message, ToolCall

__all__ = ["Known", "Rows", "Transcripts", "message_from_row", "slots_of"]

#: Runs a process remembers at most (each a transcript it may step again soon).
REMEMBERED_RUNS = 32
#: Bytes of stored messages a process remembers at most, over all runs.
REMEMBERED_BYTES = 16 * 1024 * 1024
#: A run not stepped by this process for this long is forgotten (it finished elsewhere, or moves slowly).
REMEMBERED_FOR_S = 30.0


def slots_of(messages: Sequence[Message]) -> list[int]:
    """The slot of each message: its index, except results of a last turn that still misses some.

    Those go to the turn's slot plus one plus their call's position, so results stored out of order keep
    their place. When the rule would not give strictly increasing slots (a transcript sent whole by a
    caller, results of unknown calls), every slot is its index.
    """
    count = len(messages)
    slots = list(range(count))
    turn = count - 1
    while turn >= 0 and messages[turn].role == "tool":
        turn -= 1
    if turn < 0 or turn == count - 1 or messages[turn].role != "assistant":
        return slots
    order = {call.id: position for position, call in enumerate(messages[turn].tool_calls or ())}
    previous = turn
    for index in range(turn + 1, count):
        position = order.get(messages[index].tool_call_id or "")
        if position is None or turn + 1 + position <= previous:
            return list(range(count))
        previous = slots[index] = turn + 1 + position
    return slots


def stable_prefix(messages: Sequence[Message], slots: Sequence[int]) -> int:
    """How many leading messages no later save can place anything before: those whose slot is their index.

    Results still missing go between the last turn and the results already in, so a claim must ask again
    for everything past the turn.
    """
    count = len(messages)
    if count and slots[-1] != count - 1:
        index = count - 1
        while index >= 0 and messages[index].role == "tool":
            index -= 1
        return index + 1
    return count


def message_from_row(body: dict[str, Any]) -> Message:
    """A stored message, without validating again what was validated before it was written."""
    calls = body.get("tool_calls")
    fields = {key: body.get(key) for key in ("role", "content", "tool_call_id", "name", "is_error", "replaced_by_hook")}
    if calls is not None:
        fields["tool_calls"] = [
            ToolCall.model_construct(
                id=c["id"], name=c["name"], args=c.get("args") or {}, invalid_args=c.get("invalid_args")
            )
            for c in calls
        ]
    else:
        fields["tool_calls"] = None
    return Message.model_construct(**fields)


@dataclass
class Known:
    """What a process read or wrote of one run's transcript, as of save ``seq``."""

    transcript_id: int
    seq: int
    messages: list[Message]
    slots: list[int]
    sizes: list[int]
    bytes: int = 0

    @property
    def stable(self) -> int:
        """Rows before this slot are as remembered; a claim reads only those from it on."""
        return stable_prefix(self.messages, self.slots)


@dataclass
class Rows:
    """What a save writes of the transcript: rows to add (or replace) and stored slots that go."""

    #: ``[slot, message]`` pairs, serialized, for the save's ``jsonb_array_elements``.
    body: str
    added: list[tuple[int, Message, int]] = field(default_factory=list)
    gone: list[int] = field(default_factory=list)
    #: True when stored messages changed: the run's transcript id is renewed.
    rewrites: bool = False
    #: Serialized size of the whole transcript after the save.
    total_bytes: int = 0


def diff(known: Known, messages: Sequence[Message]) -> Rows:
    """The rows that turn the transcript ``known`` into ``messages``.

    A step only appends (and places results among the last turn's), so only new messages are serialized;
    stored messages are recognised by identity first (a step's checkpoint shares them with what it loaded),
    then by equality. Anything else (a changed or dropped stored message) is a rewrite.
    """
    slots = slots_of(messages)
    start = min(known.stable, len(messages))
    begin = start if all(map(operator.is_, messages[:start], known.messages[:start])) else 0
    stored = {slot: index for index, slot in enumerate(known.slots[begin:], begin)}
    added: list[tuple[int, Message]] = []
    kept: set[int] = set()
    rewrites = False
    for index in range(begin, len(messages)):
        slot, message = slots[index], messages[index]
        at = stored.get(slot)
        if at is not None and (known.messages[at] is message or known.messages[at] == message):
            kept.add(slot)
            continue
        rewrites = rewrites or at is not None
        added.append((slot, message))
    written = {slot for slot, _ in added}
    gone = [slot for slot in known.slots[begin:] if slot not in kept and slot not in written]
    return _rows(known, added, gone, rewrites or bool(gone))


def _rows(known: Known, added: list[tuple[int, Message]], gone: list[int], rewrites: bool) -> Rows:
    """Serialize the added messages; the transcript's total size follows from the remembered sizes."""
    pairs, sized = [], []
    for slot, message in added:
        text = payloads.dumps(message.dump())
        pairs.append(f"[{slot},{text}]")
        sized.append((slot, message, len(text.encode("utf-8"))))
    total = known.bytes + sum(size for _, _, size in sized)
    if rewrites:
        replaced = {slot for slot, _, _ in sized} | set(gone)
        total -= sum(size for slot, size in zip(known.slots, known.sizes, strict=True) if slot in replaced)
    return Rows(body="[" + ",".join(pairs) + "]", added=sized, gone=sorted(gone), rewrites=rewrites, total_bytes=total)


def after_save(known: Known, rows: Rows, seq: int, messages: list[Message], transcript_id: int) -> Known:
    """What is stored once ``rows`` were written by save ``seq`` (the transcript is now ``messages``)."""
    slots = slots_of(messages)
    start = 0 if rows.rewrites else min(known.stable, len(messages))
    tail = dict(zip(known.slots[start:], known.sizes[start:], strict=True))
    for slot in rows.gone:
        tail.pop(slot, None)
    for slot, _, size in rows.added:
        tail[slot] = size
    sizes = known.sizes[:start] + [tail.get(slot, 0) for slot in slots[start:]]
    return Known(
        transcript_id=transcript_id, seq=seq, messages=messages, slots=slots, sizes=sizes, bytes=rows.total_bytes
    )


def from_rows(transcript_id: int, seq: int, rows: Iterable[tuple[int, dict[str, Any], int]]) -> Known:
    """A whole stored transcript: ``(slot, message, size)`` rows in slot order."""
    return _with_rows(transcript_id, seq, [], [], [], rows)


def extend(known: Known, transcript_id: int, seq: int, tail: Iterable[tuple[int, dict[str, Any], int]]) -> Known:
    """``known`` with the stored rows from its stable prefix on replaced by ``tail`` (as read at ``seq``)."""
    keep = known.stable
    return _with_rows(transcript_id, seq, known.slots[:keep], known.messages[:keep], known.sizes[:keep], tail)


def _with_rows(
    transcript_id: int,
    seq: int,
    slots: list[int],
    messages: list[Message],
    sizes: list[int],
    rows: Iterable[tuple[int, dict[str, Any], int]],
) -> Known:
    """The transcript ``slots``/``messages``/``sizes`` followed by ``rows``, parsed."""
    for slot, body, size in rows:
        slots.append(slot)
        messages.append(message_from_row(body))
        sizes.append(size)
    return Known(transcript_id=transcript_id, seq=seq, messages=messages, slots=slots, sizes=sizes, bytes=sum(sizes))


class Transcripts:
    """The transcripts this process read or wrote lately, by run: least recently used go first."""

    def __init__(
        self,
        runs: int = REMEMBERED_RUNS,
        max_bytes: int = REMEMBERED_BYTES,
        max_age_s: float = REMEMBERED_FOR_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._runs = runs
        self._max_bytes = max_bytes
        self._max_age_s = max_age_s
        self._clock = clock
        self._bytes = 0
        self._known: OrderedDict[str, tuple[Known, float]] = OrderedDict()
        # A batch saves from its tool threads, and a process may delete runs from others.
        self._lock = threading.Lock()

    def get(self, session_id: str) -> Known | None:
        """What is remembered of the run, or None."""
        with self._lock:
            found = self._known.get(session_id)
            if found is None:
                return None
            self._known[session_id] = (found[0], self._clock())
            self._known.move_to_end(session_id)
            return found[0]

    def remember(self, session_id: str, known: Known) -> None:
        """Remember ``known`` as the run's stored transcript (it replaces what was remembered)."""
        with self._lock:
            self._drop(session_id)
            now = self._clock()
            if known.bytes <= self._max_bytes // 2:
                self._known[session_id] = (known, now)
                self._bytes += known.bytes
            # Least recently used first: drop while over a bound, or too long unused.
            while self._known:
                oldest, (_, used) = next(iter(self._known.items()))
                if len(self._known) <= self._runs and self._bytes <= self._max_bytes and used >= now - self._max_age_s:
                    break
                self._drop(oldest)

    def forget(self, session_id: str) -> None:
        """Drop what is remembered of the run (it finished, stopped, or was changed by another process)."""
        with self._lock:
            self._drop(session_id)

    def _drop(self, session_id: str) -> None:
        dropped = self._known.pop(session_id, None)
        if dropped is not None:
            self._bytes -= dropped[0].bytes

    def __len__(self) -> int:
        return len(self._known)
