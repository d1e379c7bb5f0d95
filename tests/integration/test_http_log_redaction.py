"""A log-capture run of every process the project starts: secret-shaped values logged inside them, and real
requests to the webhook server with secrets in their query strings, leave zero matches in any output line.

Processes: the CLI (``lousho pending``, ending in an uncaught exception), ``lousho webhooks serve`` (uvicorn's
loggers included), ``lousho dev``, ``lousho demo`` and the embedded-server runner (``python -m devkit.embedded``).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx2 as httpx
import pytest

from tests.support import services
from tests.support.http_fixtures import SECRET, signed_headers
from tests.support.http_secret_logs import MARK, SECRETS

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
WRAP = "import sys; from tests.support import http_secret_logs as s; {body}"


def _database_url_with_password() -> tuple[str, str]:
    """The test database's URL with a password in it, and that password.

    A server that needs one (the embedded Postgres) has it in the URL already; one that trusts
    127.0.0.1 (CI's) accepts any password, so one is added.
    """
    url = services.test_database_url()
    parts = urlsplit(url)
    if parts.password:
        return url, parts.password
    password = "Dsn-Pass-5e4d3c2b"
    netloc = f"{parts.username or 'postgres'}:{password}@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc)), password


DATABASE_URL, DSN_PASSWORD = _database_url_with_password()


def _environment(**extra: str) -> dict[str, str]:
    env = {
        **os.environ,
        **services.test_environment(),
        "LOUSHO_DATABASE_URL": DATABASE_URL,
        "PYTHONPATH": str(ROOT),
        "OPENAI_API_KEY": SECRETS["openai key"][0],
        "ANTHROPIC_API_KEY": SECRETS["anthropic key"][0],
        "LOUSHO_WEBHOOK_SECRETS": SECRET,
        "LOUSHO_API_KEY": "api-key-Zz9Yy8Xx7Ww6",
        "PYTHONUNBUFFERED": "1",
    }
    env.update(extra)
    return env


def _leaks(output: str) -> list[str]:
    sensitive = [part for _, part in SECRETS.values()] + [DSN_PASSWORD, "api-key-Zz9Yy8Xx7Ww6"]
    return [line for line in output.splitlines() if any(part in line for part in sensitive)]


def _report(name: str, output: str, tag: str) -> None:
    lines = output.splitlines()
    leaks = _leaks(output)
    print(
        f"  {name:28} {len(lines):5} output lines, {sum(line.count('***') for line in lines):4} masks,"
        f" secret matches {len(leaks)}"
    )
    for line in leaks[:5]:
        print(f"      LEAK {line[:160]}")
    assert f"{MARK} {tag}" in output, output[-3000:]
    assert leaks == []


def _run(args: list[str], env: dict[str, str], timeout: float) -> str:
    done = subprocess.run(
        [sys.executable, "-c", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    return done.stdout + done.stderr


def _wait(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _Server:
    """A long-running entry point with its output going to a file; SIGUSR1 makes it emit the secrets."""

    def __init__(self, tag: str, body: str, env: dict[str, str], out: Path) -> None:
        self.tag, self.out = tag, out
        with out.open("wb") as sink:
            self.process = subprocess.Popen(
                [sys.executable, "-c", WRAP.format(body=body)],
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def text(self) -> str:
        return self.out.read_text(errors="replace")

    def emit_and_stop(self, stop: signal.Signals = signal.SIGINT, timeout: float = 60) -> str:
        self.process.send_signal(signal.SIGUSR1)
        _wait(lambda: f"{MARK} {self.tag}" in self.text(), 30, f"{self.tag} to log the secrets")
        self.process.send_signal(stop)
        self.process.wait(timeout)
        return self.text()

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def test_the_cli_logs_no_secret(tmp_path: Path) -> None:
    print()
    output = _run(
        [
            WRAP.format(
                body="from producer.cli import main; s.wrap('cli', lambda: main(sys.argv[1:]), then_crash=True)"
            ),
            "pending",
            "--json",
        ],
        _environment(),
        120,
    )
    assert "RuntimeError" in output  # the uncaught exception was printed, masked
    _report("lousho pending (+ crash)", output, "cli")


def test_the_embedded_server_runner_logs_no_secret(tmp_path: Path) -> None:
    print()
    output = _run(
        [
            WRAP.format(
                body="from devkit.embedded import main; s.wrap('embedded', lambda: "
                "main(['status', '--root', sys.argv[1]]))"
            ),
            str(tmp_path),
        ],
        _environment(),
        120,
    )
    _report("python -m devkit.embedded", output, "embedded")


def _signed(path: str, delivery_id: str, client: httpx.Client) -> int:
    body = json.dumps({"event": "order.paid", "card": SECRETS["openai key"][0]}).encode()
    return client.post(path, content=body, headers=signed_headers(body, delivery_id, int(time.time()))).status_code


def test_the_webhook_server_logs_no_secret(tmp_path: Path) -> None:
    print()
    port = _free_port()
    server = _Server(
        "webhooks",
        "from producer.cli import main; s.wrap('webhooks', lambda: main(['webhooks', "
        f"'serve', '--host', '127.0.0.1', '--port', '{port}', '--log-level', 'info']), on_signal=True)",
        _environment(),
        tmp_path / "webhooks.out",
    )
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:

            def up() -> bool:
                assert server.process.poll() is None, server.text()[-3000:]
                try:
                    return client.get("/healthz").status_code == 200
                except httpx.TransportError:
                    return False

            _wait(up, 60, "the webhook server")
            key_param = SECRETS["api_key parameter"][1]
            statuses = [
                _signed(f"/webhooks/hooks?api_key={key_param}&password=Hunter2-Pass-0000", "msg_1", client),
                _signed("/webhooks/hooks", SECRETS["openai key"][0], client),
                _signed(f"/webhooks/{SECRETS['openai key'][0]}?token={SECRETS['anthropic key'][0]}", "msg_2", client),
                client.get(
                    f"/runs/job-hooks-msg_1?access_token={key_param}",
                    headers={"authorization": "Bearer " + SECRETS["bearer token"][1]},
                ).status_code,
                client.get(f"/runs/x?secret={SECRETS['webhook secret'][0]}").status_code,
            ]
            github = {
                "content-type": "application/json",
                "x-github-delivery": "d-1",
                "x-hub-signature-256": "sha256=" + hmac.new(b"x", b"{}", hashlib.sha256).hexdigest(),
            }
            statuses.append(
                client.post(
                    f"/webhooks/hooks?client_secret={base64.b64encode(b'x' * 12).decode()}",
                    content=b"{}",
                    headers=github,
                ).status_code
            )
        output = server.emit_and_stop()
    finally:
        server.kill()
    print(f"  requests answered {statuses}")
    assert statuses[:2] == [202, 202] and '"POST /webhooks/hooks?' in output  # the access log is on
    _report("lousho webhooks serve", output, "webhooks")


def test_lousho_dev_logs_no_secret(tmp_path: Path) -> None:
    print()
    server = _Server(
        "dev",
        "from producer.cli import main; s.wrap('dev', lambda: main(['dev', '--concurrency', '1']), on_signal=True)",
        _environment(LOUSHO_AGENTS="examples.shop"),
        tmp_path / "dev.out",
    )
    try:
        _wait(lambda: "Ctrl-C stops" in server.text() or server.process.poll() is not None, 90, "lousho dev")
        assert server.process.poll() is None, server.text()[-3000:]
        output = server.emit_and_stop()
    finally:
        server.kill()
    _report("lousho dev", output, "dev")


def test_lousho_demo_logs_no_secret(tmp_path: Path) -> None:
    print()
    output = _run(
        [WRAP.format(body="from producer.cli import main; s.wrap('demo', lambda: main(['demo']))")], _environment(), 240
    )
    assert "final answer" in output, output[-3000:]
    _report("lousho demo", output, "demo")
