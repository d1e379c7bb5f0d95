"""``lousho webhooks serve`` stops on SIGTERM even while an event stream is open (it waits a bounded time)."""

from __future__ import annotations

import base64
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx2 as httpx
import pytest

from producer.client import Client
from producer.http import serve
from tests.support import services
from tests.support.driver import client  # noqa: F401  # the fixture, registered here

pytestmark = pytest.mark.integration

API_KEY = "shutdown-api-key-2b7e"
SECRET = "whsec_" + base64.b64encode(b"lousho-shutdown-secret-0123456789").decode()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_server_with_an_open_event_stream_stops_within_its_grace_period(client: Client) -> None:  # noqa: F811
    client.agent("idle").send("nobody steps me", session_id="shutdown-1", check_agent=False)
    port = _free_port()
    env = {**os.environ, **services.test_environment(), "LOUSHO_API_KEY": API_KEY, "LOUSHO_WEBHOOK_SECRETS": SECRET}
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "producer.cli",
            "webhooks",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and server.poll() is None, "the server did not come up"
            time.sleep(0.1)
        opened = threading.Event()

        def read() -> None:
            try:
                with httpx.stream(
                    "GET",
                    f"http://127.0.0.1:{port}/runs/shutdown-1/events",
                    headers={"authorization": f"Bearer {API_KEY}"},
                    timeout=60,
                ) as response:
                    assert response.status_code == 200
                    opened.set()
                    for _ in response.iter_bytes():
                        pass
            except httpx.HTTPError:
                pass  # the server closed the stream

        threading.Thread(target=read, daemon=True).start()
        assert opened.wait(15), "the event stream did not open"
        time.sleep(0.3)
        stopped_at = time.monotonic()
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=serve.GRACEFUL_SHUTDOWN_S + 10)
        took = time.monotonic() - stopped_at
        print(f"server stopped {took:.2f} s after SIGTERM with an event stream open")
        assert took < serve.GRACEFUL_SHUTDOWN_S + 5
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
