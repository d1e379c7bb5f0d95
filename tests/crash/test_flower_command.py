"""``lousho flower`` starts a real Flower on Lousho's app with authentication and the columns that show runs: its
HTTP API answers a caller with the credentials (and refuses one without), and its tasks page shows the kwargs,
result and exception columns. Without credentials configured it refuses to start."""

from __future__ import annotations

import base64
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from importlib.util import find_spec

import pytest

from tests.support.cluster import ROOT, Cluster, wait_until
from tests.support.flower_ui import free_port

USER, PASSWORD = "lousho", "flower-command-password"
SHOWN = ["name", "uuid", "state", "kwargs", "result", "exception", "received", "runtime", "worker"]


def _get(url: str, auth: bool) -> tuple[int, str]:
    headers = {"Authorization": "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()} if auth else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except (urllib.error.URLError, OSError):
        return 0, ""  # not listening yet


def test_lousho_flower_serves_its_api_and_the_run_columns_behind_authentication(
    make_cluster: Callable[..., Cluster],
) -> None:
    if find_spec("flower") is None:
        if os.environ.get("CI"):
            pytest.fail("the flower package is not installed")
        pytest.skip("the flower package is not installed")
    cluster = make_cluster()
    port = free_port()
    env = {**cluster.env(), "FLOWER_BASIC_AUTH": f"{USER}:{PASSWORD}"}
    log_path = cluster.workdir / "flower.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "producer.cli", "flower", "--port", str(port)],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(
            lambda: process.poll() is None and _get(f"{base}/healthcheck", auth=True)[0] == 200,
            30,
            f"Flower answering (log: {log_path})",
        )

        assert _get(f"{base}/api/tasks", auth=False)[0] == 401
        status, body = _get(f"{base}/api/tasks", auth=True)
        assert status == 200 and body.strip().startswith("{")
        status, page = _get(f"{base}/tasks", auth=True)
        assert status == 200 and re.findall(r'<th data-column="(\w+)"', page) == SHOWN
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def test_lousho_flower_refuses_to_start_without_credentials(make_cluster: Callable[..., Cluster]) -> None:
    cluster = make_cluster()
    env = {name: value for name, value in cluster.env().items() if not name.startswith("FLOWER_")}

    done = subprocess.run(
        [sys.executable, "-m", "producer.cli", "flower"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("error LOUSHO_CONFIG_INVALID: Flower never runs without authentication")


def test_lousho_flower_passes_more_flower_options_after_a_double_dash() -> None:
    from producer.cli import build_parser, flower

    args = build_parser().parse_args(["flower", "--app", "myapp", "--port", "5600", "--", "--url_prefix=flower"])

    assert flower.flower_argv("celery", args) == [
        "celery",
        "-A",
        "myapp",
        "flower",
        "--address=127.0.0.1",
        "--port=5600",
        f"--tasks_columns={','.join(SHOWN)}",
        "--url_prefix=flower",
    ]
