"""A webhook storm against a real uvicorn on 127.0.0.1: 30 delivery ids x 5 concurrent copies make exactly 30 runs.

Also 5 bad signatures and 5 stale timestamps (no rows), and the 2 MiB cap over real HTTP. Prints the figures.
"""

from __future__ import annotations

import base64
import json
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator

import httpx2 as httpx
import pytest
import uvicorn
from sqlalchemy import text

from tests.support.http_fixtures import OLD_SECRET, Receiver, noted, signed_headers

pytestmark = pytest.mark.integration

IDS, COPIES, CONNECTIONS = 30, 5, 50


@pytest.fixture
def server(receiver: Receiver) -> Iterator[str]:
    config = uvicorn.Config(
        receiver.app, host="127.0.0.1", port=0, log_level="warning", lifespan="off", limit_concurrency=200
    )
    running = uvicorn.Server(config)
    thread = threading.Thread(target=running.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not running.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    port = running.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    running.should_exit = True
    thread.join(timeout=10)


def _plan() -> list[dict[str, object]]:
    """The requests in send order: the copies of one id are adjacent, so the workers send them at once."""
    now = int(time.time())
    plan: list[dict[str, object]] = []

    def add(delivery_id: str, body: bytes, headers: dict[str, str]) -> None:
        plan.append(
            {"id": delivery_id, "path": "/webhooks/hooks", "body": base64.b64encode(body).decode(), "headers": headers}
        )

    for n in range(IDS):
        body = json.dumps({"event": "storm", "n": n}).encode()
        for copy in range(COPIES):
            # Redeliveries are signed again (new timestamp, sometimes the rotated secret): same id, same body.
            secret = {"secret": OLD_SECRET} if copy % 2 else {}
            add(f"storm-{n}", body, signed_headers(body, f"storm-{n}", now - copy, **secret))
        if n % 3 == 0 and n // 3 < 5:
            forged = b'{"event": "forged"}'
            add(f"forged-{n}", forged + b" ", signed_headers(forged, f"forged-{n}", now))
            add(f"stale-{n}", forged, signed_headers(forged, f"stale-{n}", now - 600))
    return plan


def _storm(base: str) -> list[dict[str, object]]:
    sent = subprocess.run(
        [sys.executable, "-m", "tests.support.http_sender", base, "--connections", str(CONNECTIONS), "--timeout", "60"],
        input=json.dumps(_plan()),
        capture_output=True,
        text=True,
        timeout=90,
        check=True,
    )
    results: list[dict[str, object]] = json.loads(sent.stdout)
    return results


def test_a_storm_of_redeliveries_makes_exactly_one_run_per_delivery_and_all_finish(
    receiver: Receiver, server: str
) -> None:
    started = time.perf_counter()
    results = _storm(server)
    wall = time.perf_counter() - started
    accepted = [r for r in results if r["status"] == 202]
    rejected = [r for r in results if r["status"] != 202]
    assert len(accepted) == IDS * COPIES and len(rejected) == 10
    assert all(r["status"] == 401 for r in rejected)
    sessions: dict[str, set[str]] = {}
    new: Counter[str] = Counter()
    for r in accepted:
        body = r["body"]
        assert isinstance(body, dict)
        sessions.setdefault(str(r["id"]), set()).add(str(body["session_id"]))
        new[str(r["id"])] += 1 if body["duplicate"] is False else 0

    receiver.driver.drain()

    with receiver.engine.connect() as conn:
        rows = conn.execute(text("SELECT session_id, status, inbox_head FROM runs")).all()
        runs: dict[str, str] = {row.session_id: row.status for row in rows}
        inbox_heads: dict[str, int] = {row.session_id: row.inbox_head for row in rows}
        deliveries = conn.execute(text("SELECT count(*) FROM deliveries")).scalar_one()
    runs_per_id = Counter(len(s) for s in sessions.values())
    latencies = sorted(float(str(r["elapsed"])) * 1000 for r in accepted)
    p50, p99 = statistics.median(latencies), latencies[int(0.99 * (len(latencies) - 1))]
    print(
        f"\nwebhook storm: {IDS} ids x {COPIES} concurrent copies over {CONNECTIONS} connections"
        f" + 5 bad signatures + 5 stale timestamps, {len(results)} requests in {wall:.2f} s"
    )
    print(
        f"  unique ids {len(sessions)}, runs created {len(runs)}, deliveries {deliveries},"
        f" runs per delivery id {dict(runs_per_id)}, first-copy answers per id {dict(Counter(new.values()))}"
    )
    print(
        f"  duplicate runs {len(runs) - len(sessions)}, rejected {len(rejected)} -> runs 0,"
        f" finished {sum(1 for s in runs.values() if s == 'finished')}/{len(runs)}, tool executions {len(noted)}"
    )
    print(f"  intake latency p50 {p50:.1f} ms, p99 {p99:.1f} ms, max {latencies[-1]:.1f} ms")
    assert len(sessions) == IDS and runs_per_id == {1: IDS}
    assert len(runs) == IDS and deliveries == IDS
    assert set(new.values()) == {1} and len(new) == IDS
    assert set(inbox_heads.values()) == {1}
    assert all(status == "finished" for status in runs.values())
    assert sorted(noted) == sorted(s for group in sessions.values() for s in group)


def test_a_two_mib_body_is_413_over_real_http_with_or_without_content_length(receiver: Receiver, server: str) -> None:
    big = b'{"pad":"' + b"x" * (2 * 1024 * 1024) + b'"}'
    headers = signed_headers(big, "big-1", int(time.time()))
    with httpx.Client(base_url=server, timeout=30) as client:
        sized = client.post("/webhooks/hooks", content=big, headers=headers)
        chunks = (big[i : i + 65536] for i in range(0, len(big), 65536))
        streamed = client.post("/webhooks/hooks", content=chunks, headers=headers)
    assert sized.status_code == 413 and streamed.status_code == 413
    with receiver.engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM deliveries")).scalar_one() == 0
        assert conn.execute(text("SELECT count(*) FROM runs")).scalar_one() == 0
