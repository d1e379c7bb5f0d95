"""A reader of a run's events (``producer.streams.follow``) against a scripted store and channel: the live signals
of the last turn are all yielded before its ``run.done``, however the reads and the notes interleave."""

from __future__ import annotations

import json
from collections import deque
from datetime import UTC, datetime
from typing import Any, cast

from producer import streams
from store import interfaces
from store.events import Event
from store.signals import RedisSignals

AT = datetime(2026, 1, 1, tzinfo=UTC)


def _durable(seq: int, event_type: str) -> Event:
    return Event(run_id="w-1", seq=seq, type=event_type, at=AT, data={})


def _delta(text: str) -> dict[str, Any]:
    return {"data": json.dumps({"type": "text.delta", "data": {"text": text}, "at": AT.isoformat()})}


class _Channel:
    """A subscription whose messages the test queues."""

    def __init__(self) -> None:
        self.queued: deque[dict[str, Any]] = deque()

    def get_message(self, timeout: float) -> dict[str, Any] | None:
        return self.queued.popleft() if self.queued else None

    def close(self) -> None:
        pass


class _Signals:
    def __init__(self, channel: _Channel) -> None:
        self.channel = channel

    def subscribe(self, session_id: str) -> _Channel:
        return self.channel

    def watch(self, session_id: str, ttl_ms: int) -> None:
        pass


class _Store:
    """Events as a worker writes them: the ``reads``-th read finds what ``script`` does to the channel and the log."""

    def __init__(self, channel: _Channel) -> None:
        self.events = [_durable(0, "run.start")]
        self.channel = channel
        self.reads = 0

    def read_events(self, session_id: str, after: int, limit: int) -> list[Event]:
        self.reads += 1
        if self.reads == 2:
            # Between the note of the first save and this read, the last turn streamed its text, saved its end and
            # published the note of that save: the read finds the end while the text is still on the channel.
            ends = {"data": '{"saved": true, "ends": true}'}
            self.channel.queued.extend([_delta("Sunny "), _delta("in Oslo."), ends])
            self.events.append(_durable(1, "run.done"))
        return [event for event in self.events if event.seq is not None and event.seq > after][:limit]

    def progress(self, session_id: str) -> object:
        return object()


def test_a_read_that_finds_the_end_after_an_earlier_note_still_yields_the_last_turn_s_text_first() -> None:
    channel = _Channel()
    channel.queued.append({"data": '{"saved": true}'})  # the note of the save that wrote run.start
    store = _Store(channel)
    followed = streams.follow(
        cast(interfaces.ProducerStore, store), cast(RedisSignals, _Signals(channel)), "w-1", -1, live=True, timeout=5
    )
    got = [(event.type, event.data.get("text")) for event in followed]
    assert got == [("run.start", None), ("text.delta", "Sunny "), ("text.delta", "in Oslo."), ("run.done", None)]


def test_a_run_done_no_note_follows_is_yielded_after_at_most_one_poll_interval() -> None:
    # A run.done written without a note (a client's abort): the reader waits at most POLL_S for one, then goes on.
    channel = _Channel()
    store = _Store(channel)
    store.events.append(_durable(1, "run.done"))
    store.reads = 5  # no script
    followed = streams.follow(
        cast(interfaces.ProducerStore, store), cast(RedisSignals, _Signals(channel)), "w-1", -1, live=True, timeout=5
    )
    assert [event.type for event in followed] == ["run.start", "run.done"]
