"""``GET /runs/{session_id}/events`` as Server-Sent Events: where to start, the frames, keep-alives and the end.

Owns the SSE framing and pacing; the events come from ``Client.events_async`` (pulled in the app's event threads,
stopped soon after the client goes away). It never writes a run.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator

import anyio
from starlette.requests import Request

from producer.http import headers
from producer.http.rejections import bad_request
from store import errors
from store.events import Event

log = logging.getLogger("lousho.webhooks")

#: Seconds without a frame after which a keep-alive comment is sent (proxies drop idle connections).
KEEPALIVE_S = 15.0
#: Threads pulling events at once (``Client.events_async``'s executor); a stream beyond them waits for one (its
#: keep-alives still flow).
STREAM_THREADS = 200
#: The response headers of an event stream besides its content type.
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MEDIA_TYPE = "text/event-stream"
#: A comment line: clients ignore it, proxies see traffic.
KEEPALIVE_FRAME = ": keep-alive\n\n"
#: The last frame of a stream that reached its ``run.done``.
DONE_FRAME = "event: done\ndata: {}\n\n"

_SEQ = re.compile(r"-1|[0-9]{1,18}")
_TRUE, _FALSE = frozenset({"1", "true", "yes", "on"}), frozenset({"", "0", "false", "no", "off"})


def _seq(value: str, name: str) -> int:
    if not _SEQ.fullmatch(value.strip()):
        raise bad_request(f"{name} must be an event seq (an integer from -1)")
    return int(value)


def resume_after(request: Request) -> int | None:
    """The seq to resume after: ``Last-Event-ID`` (it wins), else the ``after`` query, else None.

    None means "from the run's latest ``run.start``". An empty ``Last-Event-ID`` counts as absent.

    Raises:
        Rejected: 400 for a value that is not a seq, or a repeated header or query.
    """
    last = headers.one(request.headers, "last-event-id")
    if last is not None and last.strip():
        return _seq(last, "Last-Event-ID")
    after = request.query_params.getlist("after")
    if len(after) > 1:
        raise bad_request("after is given more than once")
    return _seq(after[0], "after") if after else None


def wants_live(request: Request) -> bool:
    """Whether the ``live`` query asks for live signals (``live=1``).

    Raises:
        Rejected: 400 for a value that is not a boolean.
    """
    values = request.query_params.getlist("live")
    value = values[0].strip().lower() if len(values) == 1 else "0" if not values else "?"
    if value not in _TRUE | _FALSE:
        raise bad_request("live must be 1 or 0")
    return value in _TRUE


def frame(event: Event) -> str:
    """One event as an SSE frame: ``id:`` (durable events only), ``event:`` and one ``data:`` line of JSON."""
    data = json.dumps(event.wire(), separators=(",", ":"))
    if event.seq is None:
        return f"event: {event.type}\ndata: {data}\n\n"
    return f"id: {event.seq}\nevent: {event.type}\ndata: {data}\n\n"


def error_frame(code: str) -> str:
    """A failure after the stream started: an ``error`` frame without an id (reconnecting resumes)."""
    body = {"error": {"code": code, "message": "the event stream failed; reconnect to resume"}}
    return f"event: error\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"


async def stream(session_id: str, source: AsyncIterator[Event]) -> AsyncIterator[str]:
    """The frames of ``source``: each event, a keep-alive after ``KEEPALIVE_S`` idle seconds, ``done`` at the end.

    The stream ends after the first ``run.done`` (with a ``done`` frame); if ``source`` fails, with an
    ``error`` frame and no ``done``, so the client reconnects with ``Last-Event-ID``. When the response is
    cancelled (the client went away) the pending read is cancelled and ``source`` closed.
    """
    pending: asyncio.Future[Event] | None = None
    try:
        while True:
            pending = asyncio.ensure_future(anext(source))
            while not (await asyncio.wait({pending}, timeout=KEEPALIVE_S))[0]:
                yield KEEPALIVE_FRAME
            try:
                event = pending.result()
            except StopAsyncIteration:
                return
            except errors.LoushoError as exc:
                log.warning("the event stream of run %s failed: %s", session_id, exc.code)
                yield error_frame(exc.code)
                return
            finally:
                pending = None
            yield frame(event)
            if event.type == "run.done":
                yield DONE_FRAME
                return
    finally:
        await _close(source, pending)


async def _close(source: AsyncIterator[Event], pending: asyncio.Future[Event] | None) -> None:
    """Stop pulling: cancel a read in flight, then close ``source`` once nothing reads it any more."""
    aclose = getattr(source, "aclose", None)
    if pending is not None and not pending.done():
        pending.cancel()
        if aclose is not None:
            # The read may take a moment to notice; close the source after it, without holding up the response.
            pending.add_done_callback(lambda _: asyncio.ensure_future(aclose()))
        return
    if aclose is not None:
        with anyio.CancelScope(shield=True):
            await aclose()
