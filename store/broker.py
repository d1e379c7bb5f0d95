"""Which runs have a step message in the broker: waiting in a queue, or taken by a worker that has not acked it.

Reads the Celery Redis transport's own keys with plain Redis commands, never through Celery: a queue is a list
named after it (a message sent with a priority goes to a list whose name adds kombu's separator and the priority),
and a message a worker took is kept in the ``unacked`` hash until it is acked. Each message is JSON whose base64
body holds the task's ``[args, kwargs, embed]``; ``lousho.advance`` carries ``session_id`` and ``seq`` only. It
must not write to the broker, and a message it cannot read is skipped (it is not ours, or not a step).
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import redis

from store import step_message
from store.redis_client import translated
from store.summaries import MessagePlace

#: Where the transport keeps messages workers took and did not ack yet (kombu's defaults).
UNACKED_KEY = "unacked"
#: Kombu's separator between a queue's name and its priority, and the priorities it keeps lists for.
_PRIORITY_SEP = "\x06\x16"
_PRIORITIES = (3, 6, 9)
#: Messages read per command.
_CHUNK = 1000
#: Most messages one look reads in all (a backlog beyond it is left unread, and ``Scan.complete`` says so).
MAX_MESSAGES = 200_000


@dataclass(frozen=True)
class StepMessage:
    """A step message seen in the broker: the run, the seq it is for (None: any), and where it is."""

    session_id: str
    seq: int | None
    place: MessagePlace


@dataclass(frozen=True)
class Scan:
    """The step messages seen, and whether every message of the queues and the unacked hash was read."""

    messages: tuple[StepMessage, ...]
    complete: bool

    def for_run(self, session_id: str, seq: int) -> MessagePlace | None:
        """Where a message that would move the run at ``seq`` is (one for another seq is dropped as stale)."""
        places = {m.place for m in self.messages if m.session_id == session_id and m.seq in (None, seq)}
        return "reserved" if "reserved" in places else "queued" if "queued" in places else None


@translated
def waiting(client: redis.Redis, queue: str) -> int:
    """Messages sent without a priority (as steps are) that wait in ``queue``: one LLEN of its list.

    Raises:
        StorageError: Redis cannot be reached.
    """
    return int(client.llen(queue))


@translated
def scan(client: redis.Redis, queues: Iterable[str], wanted: set[str] | None = None, limit: int = MAX_MESSAGES) -> Scan:
    """The step messages in ``queues`` (queued) and in the unacked hash (reserved), of the runs ``wanted`` (None: all).

    Raises:
        StorageError: the broker could not be read.
    """
    found: list[StepMessage] = []
    read = 0
    for key in _keys(queues):
        start = 0
        while read < limit:
            chunk = client.lrange(key, start, start + _CHUNK - 1)
            if not chunk:
                break
            read += len(chunk)
            start += len(chunk)
            found.extend(_wanted((_decode(raw) for raw in chunk), wanted, "queued"))
    cursor = 0
    while read < limit:
        cursor, entries = client.hscan(UNACKED_KEY, cursor, count=_CHUNK)
        values = list(entries.values()) if isinstance(entries, dict) else []
        read += len(values)
        found.extend(_wanted((_decode_unacked(raw) for raw in values), wanted, "reserved"))
        if cursor == 0:
            break
    return Scan(tuple(found), read < limit)


def _keys(queues: Iterable[str]) -> Iterator[str]:
    for queue in dict.fromkeys(queues):
        yield queue
        for priority in _PRIORITIES:
            yield f"{queue}{_PRIORITY_SEP}{priority}"


def _wanted(
    decoded: Iterable[tuple[str, int | None] | None], wanted: set[str] | None, place: MessagePlace
) -> list[StepMessage]:
    return [
        StepMessage(session_id, seq, place)
        for session_id, seq in (d for d in decoded if d is not None)
        if wanted is None or session_id in wanted
    ]


def _decode_unacked(raw: bytes | str) -> tuple[str, int | None] | None:
    """An unacked entry is ``[message, exchange, routing_key]``."""
    try:
        entry = json.loads(raw)
    except ValueError:
        return None
    return _message(entry[0]) if isinstance(entry, list) and entry and isinstance(entry[0], dict) else None


def _decode(raw: bytes | str) -> tuple[str, int | None] | None:
    try:
        message = json.loads(raw)
    except ValueError:
        return None
    return _message(message) if isinstance(message, dict) else None


def _message(message: dict[str, Any]) -> tuple[str, int | None] | None:
    """The run id and seq of a ``lousho.advance`` message (protocol 2), or None for anything else."""
    headers = message.get("headers")
    if not isinstance(headers, dict) or headers.get("task") != step_message.ADVANCE:
        return None
    body: Any = message.get("body")
    properties = message.get("properties")
    try:
        if isinstance(properties, dict) and properties.get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args, kwargs, _ = json.loads(body)
    except (binascii.Error, ValueError, TypeError):
        return None
    session_id = kwargs.get("session_id") if isinstance(kwargs, dict) else None
    if session_id is None and isinstance(args, list) and args:
        session_id = args[0]
    seq = kwargs.get("seq") if isinstance(kwargs, dict) else None
    if seq is None and isinstance(args, list) and len(args) > 1:
        seq = args[1]
    if not isinstance(session_id, str) or (seq is not None and not isinstance(seq, int)):
        return None
    return session_id, seq


__all__ = ["MAX_MESSAGES", "UNACKED_KEY", "Scan", "StepMessage", "scan"]
