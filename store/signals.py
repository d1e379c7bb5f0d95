"""A run's signals in Redis: who watches its events, abort doorbells, steer marks, and its event channel.

Signals only make things faster: every request they carry is also durable in Postgres (an abort request is
a column, a steer is input in the inbox), and a consumer that misses a note reads the events from Postgres
anyway. Publishing and clearing are best effort: a Redis failure is logged, never raised into a step. The calls a
caller may want to know failed (watch, ring, mark, subscribe, and reading a subscription) raise ``StorageError``.
"""

from __future__ import annotations

import logging
from typing import Any

import redis

from store import keys, records
from store.redis_client import translated

__all__ = ["RedisSignals", "Subscription"]

log = logging.getLogger(__name__)


class RedisSignals:
    """Sends and reads the signals of runs on one Redis client."""

    def __init__(self, client: redis.Redis) -> None:
        self._client = client

    def publish(self, session_id: str, payload: str) -> None:
        """Publish ``payload`` (JSON text) on the run's channel."""
        try:
            self._client.publish(keys.channel(session_id), payload)
        except redis.RedisError as exc:
            log.debug("could not publish to the channel of a run: %s", type(exc).__name__)

    @translated
    def watch(self, session_id: str, ttl_ms: int) -> None:
        """Say that a consumer reads the run's events for the next ``ttl_ms`` (steps then publish)."""
        self._client.set(keys.watch_key(records.validate_session_id(session_id)), "1", px=ttl_ms)

    @translated
    def ring_abort(self, session_id: str) -> None:
        """Ring the abort doorbell: the step holding the run hears it at its next lease renewal."""
        self._client.set(keys.abort_key(records.validate_session_id(session_id)), "1", px=keys.SIGNAL_EXPIRE_MS)

    def clear_abort(self, session_id: str) -> None:
        """Silence the abort doorbell (the abort was settled, or it was stale)."""
        try:
            self._client.delete(keys.abort_key(session_id))
        except redis.RedisError as exc:
            log.debug("could not clear the abort doorbell of a run: %s", type(exc).__name__)

    @translated
    def mark_steer(self, session_id: str, number: int) -> None:
        """Mark inbox entry ``number`` as a steer: the step holding the run starts no more calls of its turn."""
        self._client.set(keys.steer_key(records.validate_session_id(session_id)), str(number), px=keys.SIGNAL_EXPIRE_MS)

    def clear_steer(self, session_id: str) -> None:
        """Forget the steer mark (its turn paused on approvals: the calls it held back run after them)."""
        try:
            self._client.delete(keys.steer_key(session_id))
        except redis.RedisError as exc:
            log.debug("could not clear the steer mark of a run: %s", type(exc).__name__)

    @translated
    def subscribe(self, session_id: str) -> Subscription:
        """A subscription to the run's channel (the caller closes it)."""
        pubsub: redis.client.PubSub = self._client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call,unused-ignore]
        pubsub.subscribe(keys.channel(records.validate_session_id(session_id)))
        return Subscription(pubsub)


class Subscription:
    """A subscription to one run's channel, raising ``StorageError`` when Redis fails under it."""

    def __init__(self, pubsub: redis.client.PubSub) -> None:
        self._pubsub = pubsub

    @translated
    def get_message(self, timeout: float) -> dict[str, Any] | None:
        """The next message heard within ``timeout`` seconds (0: only one already received), or None."""
        message: dict[str, Any] | None = self._pubsub.get_message(timeout=timeout)
        return message

    @translated
    def close(self) -> None:
        """Unsubscribe and give the connection back."""
        self._pubsub.close()
