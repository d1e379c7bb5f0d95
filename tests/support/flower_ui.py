"""Flower as a subprocess next to a test cluster, its tasks page read through a headless Chromium, and the raw events.

``FlowerProcess`` runs ``celery -A worker flower`` on a free port of 127.0.0.1 with basic auth and no
persistence; ``TasksPage`` types into the tasks table's search box and reads the rows the browser rendered
(the cells' text, by column), not the JSON the page loads them from. ``EventTap`` listens to the same
event channel as Flower and keeps every task event, to check each sender's events whatever order they arrive in.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import redis

from tests.support import services
from tests.support.cluster import ROOT

CHROMIUM = "/usr/bin/chromium"
USER, PASSWORD = "lousho", "flower-test-password"
#: Every column the test reads; Flower's default shows neither args, kwargs, result nor exception.
COLUMNS = ("name", "uuid", "state", "args", "kwargs", "result", "exception", "received", "runtime", "worker")


def missing_prerequisite() -> str | None:
    """Why the Flower test cannot run here (no Chromium, Playwright or Flower), None when it can."""
    if not Path(CHROMIUM).exists():
        return f"{CHROMIUM} is missing (Debian's chromium package; .ci/run installs it)"
    for module, package in (("playwright.sync_api", "playwright"), ("flower", "flower")):
        if find_spec(module.partition(".")[0]) is None:
            return f"the {package} package is not installed (pip install -e '.[dev]')"
    return None


def free_port() -> int:
    """A TCP port of 127.0.0.1 nobody listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass
class FlowerProcess:
    """``celery -A worker flower`` on 127.0.0.1 with basic auth, its output in ``log_path``."""

    env: dict[str, str]
    log_path: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Flower's base URL."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start Flower (``wait_ready`` waits until it serves pages and captures events)."""
        celery = str(Path(sys.executable).with_name("celery"))
        # Flower's own event switch stays off: the steps must show because the workers' configuration
        # sends task events, not because Flower turned them on by remote control.
        args = [
            celery,
            "-A",
            "worker",
            "flower",
            f"--port={self.port}",
            "--address=127.0.0.1",
            "--persistent=False",
            "--enable_events=False",
            f"--tasks_columns={','.join(COLUMNS)}",
            "--logging=debug",
        ]
        env = {**self.env, "FLOWER_BASIC_AUTH": f"{USER}:{PASSWORD}"}
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                args,
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_ready(self, timeout: float = 20.0) -> None:
        """Block until Flower serves pages and captures events; fail with its log when it does not."""
        assert self.process is not None, "flower was not started"
        deadline = time.monotonic() + timeout
        while not (self._answers() and "Capturing events" in self.log_path.read_text(errors="replace")):
            if self.process.poll() is not None:
                raise AssertionError(f"flower exited with {self.process.returncode}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"flower did not come up in {timeout} s:\n{self.tail()}")
            time.sleep(0.1)

    def _answers(self) -> bool:
        request = urllib.request.Request(f"{self.url}/healthcheck", headers={"Authorization": self.authorization})
        try:
            with urllib.request.urlopen(request, timeout=2) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    @property
    def authorization(self) -> str:
        """The basic auth header value."""
        return "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()

    def tail(self, lines: int = 30) -> str:
        """The end of Flower's log."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def close(self) -> None:
        """Stop Flower (SIGTERM, then SIGKILL) and reap it."""
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=5)


class EventTap:
    """Every Celery event sent on the test Redis db while it listens, decoded (kombu's Redis fanout, JSON).

    Redis pub/sub channels are server-wide; kombu prefixes each with the db number (``/<db>.celeryev/...``).
    """

    def __init__(self) -> None:
        self._client = redis.Redis.from_url(services.test_redis_url())
        self._pubsub = self._client.pubsub()
        self._pubsub.psubscribe(f"/{services.TEST_REDIS_DB}.celeryev/*")
        self.events: list[dict[str, Any]] = []

    def drain(self) -> list[dict[str, Any]]:
        """Read what arrived since the last call; returns every event so far."""
        # Not ignore_subscribe_messages: it returns None for the subscription's confirmation, as if nothing came.
        while (message := self._pubsub.get_message(timeout=0.05)) is not None:
            if message["type"] != "pmessage":
                continue
            body = json.loads(base64.b64decode(json.loads(message["data"])["body"]))
            self.events.extend(body if isinstance(body, list) else [body])
        return self.events

    def task_events(self, kind: str, text: str) -> list[dict[str, Any]]:
        """The ``task-<kind>`` events whose kwargs contain ``text`` (a run id)."""
        return [e for e in self.drain() if e.get("type") == f"task-{kind}" and text in str(e.get("kwargs", ""))]

    def close(self) -> None:
        """Stop listening."""
        self._pubsub.close()
        self._client.close()


#: Rows as the browser shows them: the cells' text of each visible row, read by column slug.
_READ_ROWS = """() => {
    const heads = [...document.querySelectorAll('.dataTables_scrollHead th, #tasks-table thead th')];
    const columns = [];
    for (const th of heads) {
        const slug = th.dataset.column;
        if (slug && !columns.includes(slug)) { columns.push(slug); }
    }
    const rows = [...document.querySelectorAll('#tasks-table tbody tr')]
        .filter(tr => !tr.querySelector('td.dataTables_empty'));
    return {columns: columns, rows: rows.map(tr => [...tr.querySelectorAll('td')].map(td => td.innerText.trim())),
            processing: [...document.querySelectorAll('.dataTables_processing')]
                .some(el => el.offsetParent !== null && getComputedStyle(el).display !== 'none'),
            info: (document.querySelector('.dataTables_info') || {}).innerText || ''};
}"""


class TasksPage:
    """Flower's tasks page in a Playwright page: search it, read the rendered rows."""

    def __init__(self, page: Any, flower: FlowerProcess) -> None:
        self.page = page
        self.flower = flower

    def open(self) -> None:
        """Load ``/tasks`` and wait until the table drew its first page."""
        self.page.goto(f"{self.flower.url}/tasks", wait_until="domcontentloaded")
        self.page.wait_for_selector("#tasks-table tbody tr", timeout=15_000)
        self._settle()

    def search(self, text: str) -> None:
        """Type ``text`` into the search box, as a person would, and wait for the table to redraw."""
        box = self.page.locator("input[type=search]").first
        wanted = urllib.parse.urlencode({"search[value]": text})

        def answered(response: Any) -> bool:
            return "/tasks/datatable" in response.url and wanted in (response.request.post_data or "")

        # The table throttles its requests while keys come in: wait for the one that carries the whole text.
        with self.page.expect_response(answered, timeout=15_000):
            box.select_text()
            if text:
                box.press_sequentially(text, delay=10)
            else:
                box.press("Backspace")
        self._settle()

    def refresh(self) -> None:
        """Reload the page; the table keeps the search (DataTables saves its state) and asks the server again."""
        self.page.reload(wait_until="domcontentloaded")
        self.page.wait_for_selector("#tasks-table tbody tr", timeout=15_000)
        self._settle()

    def _settle(self) -> None:
        # The response is in; the table draws its rows right after, then hides its processing indicator.
        deadline = time.monotonic() + 10
        while self.page.evaluate(_READ_ROWS)["processing"] and time.monotonic() < deadline:
            time.sleep(0.05)

    def rows(self) -> list[dict[str, str]]:
        """The rows the table shows now, each as column slug -> the cell's rendered text."""
        found = self.page.evaluate(_READ_ROWS)
        columns: list[str] = found["columns"]
        return [dict(zip(columns, cells, strict=False)) for cells in found["rows"]]

    def text(self) -> str:
        """The whole page's visible text."""
        text: str = self.page.inner_text("body")
        return text
