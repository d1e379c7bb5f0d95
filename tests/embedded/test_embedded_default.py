"""Smoke tests of the embedded default: real Postgres and Redis from the PyPI wheels, in a temp folder.

Each test starts the servers under ``tmp_path/.lousho`` (never the project's), uses them the way the
product does (migrate, a lease, a run finished by a real ``celery worker``, ``lousho dev`` stopped by
a signal) and checks that stopping leaves no process behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import psycopg
import pytest
import redis

from devkit.embedded import EmbeddedServices, ServiceURLs
from producer.client import Client
from store.database import migrate
from store.leases import LeaseManager
from store.settings import Settings

pytestmark = [pytest.mark.embedded, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]
_URL_VARIABLES = ("LOUSHO_DATABASE_URL", "LOUSHO_REDIS_URL", "LOUSHO_BROKER_URL")


def _settings(urls: ServiceURLs) -> Settings:
    return Settings(
        database_url=urls.database_url,
        redis_url=urls.redis_url,
        lease_ttl_ms=2000,
        lease_renew_ms=500,
        recover_interval_s=1.0,
    )


def _alive(pids: list[int]) -> list[str]:
    """Processes among ``pids`` that still run (zombies count as gone), described for a failure."""
    left = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            if process.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{pid} {' '.join(process.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            continue
    return left


def _family(pid: int) -> list[int]:
    try:
        process = psutil.Process(pid)
        return [pid, *(child.pid for child in process.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def _child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _URL_VARIABLES}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


def _wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


@pytest.fixture
def embedded(tmp_path: Path) -> Iterator[EmbeddedServices]:
    services = EmbeddedServices(tmp_path, postgres_port=0, redis_port=0, durable=False)
    yield services
    services.stop()


def test_services_start_reuse_serve_a_run_and_stop_clean(embedded: EmbeddedServices, tmp_path: Path) -> None:
    began = time.monotonic()
    urls = embedded.start()
    startup = time.monotonic() - began
    assert startup < 30, f"cold start took {startup:.1f} s"
    assert embedded.started == {"postgres", "redis"}
    assert urls.database_url.startswith("postgresql://postgres:") and urls.database_url.endswith("/lousho")
    assert (tmp_path / ".lousho" / "pg" / "data" / "PG_VERSION").is_file()

    again = EmbeddedServices(tmp_path, postgres_port=0, redis_port=0)
    assert again.start() == urls, "a second start must reuse the running servers"
    assert again.started == frozenset()

    settings = _settings(urls)
    client = redis.Redis.from_url(urls.redis_url)
    try:
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        lease = LeaseManager(client, settings.lease_ttl_ms).acquire("smoke-lease")
        assert lease is not None and lease.token >= 1
        assert LeaseManager(client, settings.lease_ttl_ms).acquire("smoke-lease") is None
    finally:
        client.close()

    migrate(settings)
    with psycopg.connect(urls.database_url) as conn:
        tables = {row[0] for row in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
    assert {"runs", "inbox"} <= tables

    with (tmp_path / "worker.log").open("wb") as log:
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "worker",
                "worker",
                "-P",
                "solo",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "--loglevel",
                "WARNING",
            ],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
            env=_child_env(
                LOUSHO_DATABASE_URL=urls.database_url, LOUSHO_REDIS_URL=urls.redis_url, LOUSHO_AGENTS="examples.shop"
            ),
            start_new_session=True,
        )
    try:
        with Client(settings) as producer:
            run = producer.agent("shop").send(
                "Reserve two teas, charge 5 and ship order 7", session_id="smoke-1", check_agent=False
            )
            result = run.wait(timeout=60)
        assert result.finish_reason == "stop", (tmp_path / "worker.log").read_text()[-2000:]
        assert result.steps == 3
    finally:
        worker.terminate()
        try:
            worker.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()

    servers = embedded.processes()
    assert len(servers) >= 2
    began = time.monotonic()
    embedded.stop()
    assert time.monotonic() - began < 30
    assert _alive(servers) == []
    assert embedded.processes() == []
    assert not any(status.running for status in embedded.status().values())


def test_lousho_dev_runs_until_a_signal_and_leaves_nothing(tmp_path: Path) -> None:
    output = tmp_path / "dev.out"
    script = (
        "import sys; from pathlib import Path; from devkit.devserver import run_dev; "
        "sys.exit(run_dev(root=Path(sys.argv[1]), concurrency=1, stop_timeout=15))"
    )
    with output.open("wb") as sink:
        dev = subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path)],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=_child_env(LOUSHO_AGENTS="examples.shop"),
        )
    services = EmbeddedServices(tmp_path)
    try:
        _wait_for(lambda: "ready." in output.read_text() or dev.poll() is not None, 90, "the dev worker")
        text = output.read_text()
        assert dev.poll() is None, text
        exports = dict(
            line.strip().removeprefix("export ").split("=", 1)
            for line in text.splitlines()
            if line.strip().startswith("export LOUSHO_")
        )
        urls = ServiceURLs(exports["LOUSHO_DATABASE_URL"], exports["LOUSHO_REDIS_URL"])
        assert services.status()["postgres"].running and services.status()["redis"].running
        with Client(_settings(urls)) as producer:
            result = (
                producer.agent("shop")
                .send("Order 8, please", session_id="smoke-dev", check_agent=False)
                .wait(timeout=60)
            )
        assert result.finish_reason == "stop"

        everything = _family(dev.pid) + services.processes()
        assert len(everything) >= 5  # dev, worker (+ pool), beat, postgres (+ its processes), redis
        began = time.monotonic()
        dev.send_signal(signal.SIGINT)
        assert dev.wait(60) == 0, output.read_text()[-3000:]
        stopped_in = time.monotonic() - began
        assert stopped_in < 30, f"shutdown took {stopped_in:.1f} s"
        assert _alive(everything) == []
        assert "[dev] stopped the embedded postgres and redis" in output.read_text()
    finally:
        if dev.poll() is None:
            dev.kill()
            dev.wait()
        services.stop()
