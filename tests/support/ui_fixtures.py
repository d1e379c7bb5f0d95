"""Fixtures of the browser tests: a real worker per test, one HTTP server and one headless Chromium per module.

The server (``lousho webhooks serve`` with the run pages on and two named keys) and the browser outlive a test;
the worker does not, because every service test starts on emptied tables and a flushed Redis db, and a new
worker declares its queues again. Missing Chromium or Playwright skips the tests locally and fails them in CI.
"""

from __future__ import annotations

import base64
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

from tests.support import reports, services
from tests.support.cluster import ROOT, Cluster
from tests.support.flower_ui import CHROMIUM, free_port

#: The agents the workers and the server know: the pages' flows, the trees and drawings (``drawn_agents``), and
#: the runs whose why a page shows (``why_agents``).
UI_AGENTS = "tests.support.ui_agents,tests.support.drawn_agents,tests.support.why_agents"
#: How long a page action or expectation waits before the test fails (ms): every flow is seconds long.
PAGE_TIMEOUT_MS = 15_000


@dataclass
class UiServer:
    """``lousho webhooks serve`` on a free port of 127.0.0.1, its output in ``log_path``."""

    url: str
    #: Key name -> key: ``ops`` acts on every run, ``viewer`` only reads.
    keys: dict[str, str]
    log_path: Path
    process: subprocess.Popen[bytes]

    def tail(self, lines: int = 40) -> str:
        """The end of the server's log."""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def sign_in(new_context: Callable[..., Any], server: UiServer, **options: Any) -> Any:
    """A page signed in with the ``ops`` key by the login form, on the runs list."""
    page = new_context(**options).new_page()
    page.goto("/ui/login")
    page.locator("form#login input[name=key]").fill(server.keys["ops"])
    page.locator("form#login button[type=submit]").click()
    page.wait_for_url(re.compile(r"/ui/runs(\?.*)?$"))
    return page


def figure(name: str, started: float) -> None:
    """Print how long a browser test's part took, as the figures of the other tiers are printed."""
    print(f"figure: {name} {time.monotonic() - started:.1f} s")


def _environment(keys: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOUSHO_")}
    secret = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()
    env.update(services.test_environment())
    env.update(
        {
            "LOUSHO_AGENTS": UI_AGENTS,
            "LOUSHO_UI_ENABLED": "true",
            "LOUSHO_WEBHOOK_SECRETS": secret,
            "LOUSHO_API_KEYS": f"ops={keys['ops']},viewer={keys['viewer']};read",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def _wait_healthy(server: UiServer, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{server.url}/healthz", timeout=1) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if server.process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"the server did not come up:\n{server.tail()}")
        time.sleep(0.1)


def _check_browser() -> None:
    problem = None
    if not Path(CHROMIUM).exists():
        problem = f"{CHROMIUM} is missing (Debian's chromium package; .ci/run installs it)"
    elif find_spec("playwright") is None:
        problem = "the playwright package is not installed (pip install -e '.[dev]')"
    if problem is not None:
        if os.environ.get("CI"):
            pytest.fail(problem)
        pytest.skip(problem)


@pytest.fixture(scope="module")
def ui_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UiServer]:
    """The HTTP server with the run pages, for every test of the module (it keeps no state of its own)."""
    _check_browser()
    keys = {"ops": secrets.token_urlsafe(24), "viewer": secrets.token_urlsafe(24)}
    log_path = tmp_path_factory.mktemp("ui-server") / "server.log"
    port = free_port()
    lousho = Path(sys.executable).with_name("lousho")
    command = [str(lousho)] if lousho.exists() else [sys.executable, "-m", "producer.cli"]
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            [*command, "webhooks", "serve", "--host", "127.0.0.1", "--port", str(port)],
            cwd=ROOT,
            env=_environment(keys),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = UiServer(f"http://127.0.0.1:{port}", keys, log_path, process)
    try:
        _wait_healthy(server)
        yield server
    finally:
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=10)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


@pytest.fixture(scope="module")
def browser(ui_server: UiServer) -> Iterator[Any]:
    """One headless Chromium (Debian's) for every test of the module."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture
def new_context(browser: Any, ui_server: UiServer) -> Iterator[Callable[..., Any]]:
    """Make browser contexts (a cookie jar each) on the server's URL; all are closed when the test ends."""
    made: list[Any] = []

    def make(**options: Any) -> Any:
        context = browser.new_context(base_url=ui_server.url, **options)
        context.set_default_timeout(PAGE_TIMEOUT_MS)
        made.append(context)
        return context

    yield make
    for context in made:
        context.close()


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest, ui_server: UiServer) -> Iterator[Cluster]:
    """One ``celery worker`` (concurrency 2) on the test agents of the run pages; its logs shown on failure."""
    made = Cluster(tmp_path / "cluster", extra_env={"LOUSHO_AGENTS": UI_AGENTS})
    try:
        made.start_worker("w1", concurrency=2)
        yield made
    finally:
        if reports.failed(request):
            made.dump_logs()
            print(f"--- server log ---\n{ui_server.tail()}")
            print(f"logs kept in {made.workdir}")
        made.close()
