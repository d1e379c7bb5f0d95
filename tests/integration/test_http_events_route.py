"""``GET /runs/{id}/events`` (SSE), ``POST /runs/{id}/abort`` and ``/steer`` over a real socket, on real runs.

uvicorn serves the receiver on 127.0.0.1 in a thread; runs are stepped in this process by the driver while an
HTTP client reads the stream, drops it, and reconnects with ``Last-Event-ID``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx2 as httpx
import pytest
import uvicorn
from pydantic import SecretStr

from producer.client import Client
from producer.http import Backend, WebhookConfig, create_app
from producer.http import events as sse
from store.events import Event
from store.settings import Settings
from tests.support.driver import Driver, make_driver  # noqa: F401  # the fixture, registered here
from worker import Agent, ToolContext, tool
from worker.providers import MockModel

pytestmark = pytest.mark.integration

API_KEY = "events-api-key-51d0"
AUTH = {"authorization": f"Bearer {API_KEY}"}


@tool
def pack(item: str, ctx: ToolContext) -> str:
    """Pack an item."""
    return f"packed {item}"


@tool(needs_approval=True)
def ship(box: str) -> str:
    """Ship a box."""
    return f"shipped {box}"


def _packer() -> Agent:
    """Three turns of two parallel calls each, then the answer (and answers for follow-up input)."""
    turns: list[Any] = [
        {"tool_calls": [{"name": "pack", "args": {"item": f"{name}-{n}"}} for name in ("cup", "pan")]} for n in range(3)
    ]
    return Agent(
        name="packer",
        model=MockModel([*turns, "All packed.", "Packed again.", "Packed once more."]),
        instructions="Pack everything.",
        tools=[pack],
    )


def _shipper() -> Agent:
    return Agent(
        name="shipper",
        model=MockModel([{"tool_calls": [{"name": "ship", "args": {"box": "b1"}}]}, "Shipped."]),
        tools=[ship],
    )


@dataclass
class Frame:
    """One SSE frame as a client sees it."""

    id: str | None = None
    event: str | None = None
    data: str = ""
    comment: str | None = None


def _frames(response: httpx.Response) -> Iterator[Frame]:
    """The frames of an event-stream response, as they arrive."""
    current = Frame()
    for line in response.iter_lines():
        if line == "":
            yield current
            current = Frame()
        elif line.startswith(":"):
            current.comment = line[1:].strip()
        else:
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "data":
                current.data = f"{current.data}\n{value}" if current.data else value
            elif name in ("id", "event"):
                setattr(current, name, value)


@dataclass
class Server:
    """The receiver on a real socket, with the client its routes use and the driver that steps runs.

    ``streams`` counts the event streams the route opened and ended; ``pulls`` the blocking reads of
    ``Client.events`` its threads started and closed.
    """

    base: str
    client: Client
    driver: Driver
    streams: list[str] = field(default_factory=list)
    streams_ended: list[str] = field(default_factory=list)
    pulls: list[str] = field(default_factory=list)
    pulls_ended: list[str] = field(default_factory=list)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base, timeout=httpx.Timeout(30.0))

    def pulling(self) -> bool:
        return len(self.streams) > len(self.streams_ended) or len(self.pulls) > len(self.pulls_ended)


@pytest.fixture
def server(
    settings: Settings,
    make_driver: Callable[..., Driver],  # noqa: F811  # the fixture imported above
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Server]:
    driver = make_driver(_packer(), _shipper())
    client = Client(settings)
    made = Server(base="", client=client, driver=driver)
    follow_async, follow = client.events_async, client._follow

    async def tracked_follow(session_id: str, *args: Any, **kw: Any) -> AsyncIterator[Event]:
        made.streams.append(session_id)
        try:
            async for event in follow_async(session_id, *args, **kw):
                yield event
        finally:
            made.streams_ended.append(session_id)

    def tracked_events(session_id: str, *args: Any) -> Iterator[Event]:
        made.pulls.append(session_id)
        try:
            yield from follow(session_id, *args)
        finally:
            made.pulls_ended.append(session_id)

    monkeypatch.setattr(client, "events_async", tracked_follow)
    monkeypatch.setattr(client, "_follow", tracked_events)
    config = WebhookConfig(secrets=(b"unused-signing-key",), api_key=SecretStr(API_KEY))
    app = create_app(config, Backend.from_client(client))
    running = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=running.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not running.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    made.base = f"http://127.0.0.1:{running.servers[0].sockets[0].getsockname()[1]}"
    yield made
    running.should_exit = True
    thread.join(timeout=10)
    app.state.event_threads.shutdown(wait=True)
    client.close()


def _wait_until(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


def test_a_client_that_reconnects_with_last_event_id_gets_every_event_once_and_then_done(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sse, "KEEPALIVE_S", 0.2)
    server.client.agent("packer").send("Pack the kitchen", session_id="k-1")
    for _ in range(2):  # the first model turn, then its tool batch
        server.driver.step("k-1")

    # Given a client that read the events so far and went away
    first: list[Frame] = []
    with server.http() as http, http.stream("GET", "/runs/k-1/events", headers=AUTH) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-cache" and response.headers["x-accel-buffering"] == "no"
        for item in _frames(response):
            if item.id is not None:
                first.append(item)
            if item.event == "tool.done" and sum(f.event == "tool.done" for f in first) == 2:
                break
    _wait_until(lambda: not server.pulling(), "the server stopped pulling the dropped stream's events")

    # When it reconnects with the last id it saw while the run goes on
    seen_keepalive = threading.Event()

    def drive() -> None:
        seen_keepalive.wait(20)
        server.driver.drain()

    thread = threading.Thread(target=drive, daemon=True)
    thread.start()
    second: list[Frame] = []
    ended = False
    with (
        server.http() as http,
        http.stream(
            "GET", "/runs/k-1/events?after=0", headers={**AUTH, "Last-Event-ID": first[-1].id or ""}
        ) as response,
    ):
        assert response.status_code == 200
        for item in _frames(response):
            if item.comment == "keep-alive":
                seen_keepalive.set()
            elif item.event == "done":
                assert item.data == "{}"
                ended = True
            else:
                assert item.id is not None, item
                second.append(item)
    thread.join(30)

    # Then the two halves are the run's events: gapless, none twice, from run.start to one run.done
    union = first + second
    seqs = [int(f.id or -1) for f in union]
    stored = server.client.read_events("k-1", -1)
    print(
        f"\nfirst connection {len(first)} events (seq {seqs[0]}..{seqs[len(first) - 1]}), second {len(second)}"
        f" (seq {seqs[len(first)]}..{seqs[-1]}); keep-alive seen: {seen_keepalive.is_set()}"
    )
    assert ended and seen_keepalive.is_set()
    assert seqs == list(range(seqs[0], seqs[0] + len(union)))
    assert union[0].event == "run.start" and union[-1].event == "run.done"
    assert [f.event for f in union].count("run.done") == 1
    assert [(e.seq, e.type) for e in stored] == [(int(f.id or -1), f.event) for f in union]
    assert [f.event for f in union].count("tool.done") == 6
    assert all(Event.model_validate_json(f.data).seq == int(f.id or -1) for f in union)
    assert server.streams == server.streams_ended == ["k-1", "k-1"]
    # A read of a stream that ended stops at its next poll (``streams.POLL_S``), not necessarily before this line.
    _wait_until(lambda: not server.pulling(), "the server stopped pulling both streams' events", timeout=5.0)
    assert len(server.pulls) == len(server.pulls_ended) >= 2


def test_without_a_position_the_stream_starts_at_the_latest_input(server: Server) -> None:
    packer = server.client.agent("packer")
    packer.send("Pack the kitchen", session_id="k-2")
    server.driver.drain("k-2")
    packer.send("And the hall", session_id="k-2")
    server.driver.drain("k-2")
    stored = server.client.read_events("k-2", -1)
    second_start = [e.seq or 0 for e in stored if e.type == "run.start"][-1]

    with server.http() as http:
        latest = http.get("/runs/k-2/events", headers=AUTH)
        everything = http.get("/runs/k-2/events?after=-1", headers=AUTH)

    def ids(text: str) -> list[int]:
        return [int(line[4:]) for line in text.splitlines() if line.startswith("id: ")]

    assert ids(latest.text) == [e.seq for e in stored if e.seq is not None and e.seq >= second_start]
    assert latest.text.endswith("event: done\ndata: {}\n\n")
    # after=-1 replays from the first event and ends at the first run.done that follows
    first_done = next(e.seq for e in stored if e.type == "run.done")
    assert ids(everything.text) == list(range(0, (first_done or 0) + 1))


def test_live_signals_come_without_an_id_between_the_durable_events(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sse, "KEEPALIVE_S", 0.2)
    server.client.agent("packer").send("Pack", session_id="k-3")
    listening = threading.Event()

    def drive() -> None:
        listening.wait(20)
        server.driver.drain("k-3")

    thread = threading.Thread(target=drive, daemon=True)
    thread.start()
    frames: list[Frame] = []
    with server.http() as http, http.stream("GET", "/runs/k-3/events?live=1", headers=AUTH) as response:
        for item in _frames(response):
            if item.comment == "keep-alive":
                listening.set()  # the stream waits for the run's first event: step it now
            else:
                frames.append(item)
    thread.join(30)

    live = [f for f in frames if f.id is None and f.event != "done"]
    durable = [f for f in frames if f.id is not None]
    print(f"\nlive signals: {sorted({f.event or '' for f in live})}, durable events: {len(durable)}")
    assert frames[-1].event == "done"
    assert live, "no live signal reached the stream"
    assert all(Event.model_validate_json(f.data).seq is None for f in live)
    assert {f.event for f in live} <= {"step.start", "tool.start", "text.delta", "tool.partial"}
    assert [int(f.id or -1) for f in durable] == list(range(len(durable)))


def test_the_run_routes_refuse_a_missing_or_wrong_key_and_unknown_runs(server: Server) -> None:
    server.client.agent("packer").send("Pack", session_id="k-4")
    with server.http() as http:
        refused = [
            http.get("/runs/k-4/events"),
            http.get("/runs/k-4/events", headers={"authorization": "Bearer wrong"}),
            http.post("/runs/k-4/abort"),
            http.post("/runs/k-4/steer", json={"message": "stop"}, headers={"authorization": "Basic x"}),
        ]
        unknown = [
            http.get("/runs/nope/events", headers=AUTH),
            http.get("/runs/bad%20id/events", headers=AUTH),
            http.post("/runs/nope/abort", headers=AUTH),
            http.post("/runs/nope/steer", json={"message": "hi"}, headers=AUTH),
        ]
        malformed = [
            http.get("/runs/k-4/events?after=x", headers=AUTH),
            http.get("/runs/k-4/events", headers={**AUTH, "Last-Event-ID": "-5"}),
            http.get("/runs/k-4/events?live=maybe", headers=AUTH),
        ]

    assert [r.status_code for r in refused] == [401] * 4
    assert all(r.json()["error"]["code"] == "LOUSHO_API_KEY_INVALID" for r in refused)
    assert all(r.headers["www-authenticate"] == "Bearer" for r in refused)
    assert [r.status_code for r in unknown] == [404] * 4
    assert all(r.json()["error"]["code"] == "LOUSHO_RUN_NOT_FOUND" for r in unknown)
    assert [r.status_code for r in malformed] == [400] * 3
    assert server.streams == [] and server.pulls == []


def test_abort_stops_a_running_run_and_does_nothing_to_a_finished_one(server: Server) -> None:
    packer = server.client.agent("packer")
    packer.send("Pack", session_id="k-5")
    packer.send("Pack", session_id="k-6")
    server.driver.drain("k-6")

    with server.http() as http:
        running = http.post("/runs/k-5/abort", headers=AUTH)
        finished = http.post("/runs/k-6/abort", headers=AUTH)
    server.driver.drain("k-5")

    assert (running.status_code, running.json()) == (202, {"session_id": "k-5", "aborting": True})
    assert (finished.status_code, finished.json()) == (200, {"session_id": "k-6", "aborting": False})
    checkpoint = server.client.store.load("k-5")
    assert checkpoint is not None and checkpoint.finish_reason == "aborted"
    assert server.client.read_events("k-5", -1)[-1].data["finish_reason"] == "aborted"


def test_steer_queues_the_message_and_a_paused_run_refuses_it(server: Server) -> None:
    server.client.agent("packer").send("Pack", session_id="k-7")
    server.driver.drain("k-7")
    server.client.agent("shipper").send("Ship it", session_id="s-1")
    server.driver.drain("s-1")

    with server.http() as http:
        steered = http.post("/runs/k-7/steer", json={"message": "Use the big box"}, headers=AUTH)
        paused = http.post("/runs/s-1/steer", json={"message": "Hurry"}, headers=AUTH)
        bad = [
            http.post("/runs/k-7/steer", json=body, headers=AUTH)
            for body in ({"message": ""}, {"text": "x"}, {"message": 7}, ["x"])
        ]
        untyped = http.post("/runs/k-7/steer", content=b'{"message": "x"}', headers=AUTH)
    server.driver.drain("k-7")

    assert (steered.status_code, steered.json()) == (202, {"session_id": "k-7", "input": 2})
    assert paused.status_code == 409 and paused.json()["error"]["code"] == "LOUSHO_SESSION_AWAITING_APPROVAL"
    assert [r.status_code for r in bad] == [400] * 4
    assert untyped.status_code == 415
    checkpoint = server.client.store.load("k-7")
    assert checkpoint is not None
    assert [m.content for m in checkpoint.messages if m.role == "user"][-1] == "Use the big box"
    assert checkpoint.final_text == "Packed again."
