"""``python -m bench.listing``: what listing runs costs with 100,000 stored runs, in every state.

Recreates its own database (``--database``, ``lousho_bench_listing`` by default; Redis is not used), fills it with
``bench.stored_runs.fill_states`` (``--runs`` runs of four agents over 90 days, most finished, the rest in every other
state), then times, ``--repeat`` times each after a warm-up: the first page of ``Client.runs`` (50 runs with their
details), the store's first page without details (what the run pages read), a page 100 pages deep, a page filtered
by state and agent, the counts by state (``count_runs``), and the run pages' list view (``GET /ui/runs``, signed in,
rendered by the real server in process). Prints each figure (median, p95, max) against its target and the plans of
the listing's statements; exits 1 when the counts by state are wrong.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import psycopg
from fastapi.testclient import TestClient
from pydantic import SecretStr
from sqlalchemy import text

from bench.stored_runs import fill_states
from producer.client import Client
from producer.http.backend import Backend
from producer.http.config import WebhookConfig
from producer.server import create_app
from store import listing
from store.database import make_engine, migrate
from store.settings import Settings

#: The targets of issue 29, in milliseconds (this machine's kind: 2 cores).
TARGETS_MS = {"first page": 50.0, "counts by state": 200.0, "list view": 200.0}
_KEY = "bench-listing-key-0123456789abcdef"
_TOKEN = re.compile(r'name="csrf_token" value="([^"]+)"')


def _time(repeat: int, action: Callable[[], object]) -> list[float]:
    action()  # warm-up: plans cached, pages in the buffer cache, as on a server that has been answering
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        action()
        times.append((time.perf_counter() - started) * 1000)
    return times


def _figure(name: str, times: Sequence[float]) -> str:
    ordered = sorted(times)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    target = TARGETS_MS.get(name)
    verdict = "" if target is None else f"  (target {target:.0f} ms: {'met' if p95 < target else 'MISSED'})"
    return f"{name:<28} median {statistics.median(times):7.1f} ms  p95 {p95:7.1f} ms  max {max(times):7.1f} ms{verdict}"


def _plans(client: Client) -> None:
    """The plan of the first page's and of the counts' statements (a page reads one index range)."""
    with client.engine.connect() as conn:
        for name, statement in (
            ("first page", "SELECT session_id FROM runs ORDER BY created_at DESC, session_id DESC LIMIT 51"),
            (
                "counts by state",
                f"SELECT state, count(*) FROM (SELECT {listing.STATE} AS state FROM runs OFFSET 0) s GROUP BY state",
            ),
        ):
            plan = [row[0] for row in conn.execute(text(f"EXPLAIN {statement}"))]
            print(f"plan of the {name}: " + " / ".join(line.strip()[:160] for line in plan[:3]))


def _signed_in(settings: Settings, client: Client) -> TestClient:
    """The real server in process, signed in to the run pages with an API key."""
    config = WebhookConfig(api_key=SecretStr(_KEY), intake=False)
    app = create_app(config, Backend.from_client(client), settings=settings)
    http = TestClient(app)
    form = http.get("/ui/login")
    token = _TOKEN.search(form.text)
    if token is None:
        raise SystemExit("the sign-in page has no form: are the run pages on (LOUSHO_UI_ENABLED)?")
    answer = http.post("/ui/login", data={"key": _KEY, "csrf_token": token.group(1)}, follow_redirects=False)
    if answer.status_code != 303:
        raise SystemExit(f"could not sign in to the run pages: {answer.status_code}")
    return http


def main(argv: Sequence[str] | None = None) -> int:
    """Fill the database, time the listings, print the figures; 1 when the counts by state are wrong."""
    parser = argparse.ArgumentParser(prog="python -m bench.listing", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--server-url", default=os.environ.get("LOUSHO_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    )
    parser.add_argument("--database", default="lousho_bench_listing")
    parser.add_argument("--runs", type=int, default=100_000, help="stored runs (default 100000)")
    parser.add_argument("--repeat", type=int, default=50, help="timed repetitions of each listing (default 50)")
    args = parser.parse_args(argv)
    base = args.server_url.split("?")[0].rsplit("/", 1)[0]
    with psycopg.connect(f"{base}/postgres", autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{args.database}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{args.database}"')
    settings = Settings(
        database_url=f"{base}/{args.database}",
        redis_url=os.environ.get("LOUSHO_REDIS_URL", "redis://127.0.0.1:6379/13"),
    )
    migrate(settings)
    started = time.perf_counter()
    with psycopg.connect(settings.database_url, autocommit=True) as conn:
        expected = fill_states(conn, args.runs)
        conn.execute("VACUUM ANALYZE runs")
    print(
        f"filled {args.runs} runs in {time.perf_counter() - started:.1f} s: "
        + ", ".join(f"{state} {n}" for state, n in expected.items())
    )
    engine = make_engine(settings, pool_size=4)
    client = Client(settings, engine=engine)
    try:
        _plans(client)
        counted = client.store.count_runs()
        deep = None
        for _ in range(100):
            deep = client.store.list_runs(limit=50, cursor=deep.next_cursor if deep else None)
        cursor = deep.next_cursor if deep is not None else None
        http = _signed_in(settings, client)
        figures = {
            "first page": _time(args.repeat, lambda: client.runs(limit=50)),
            "first page, no details": _time(args.repeat, lambda: client.store.list_runs(limit=50)),
            "page 100 pages deep": _time(args.repeat, lambda: client.runs(limit=50, cursor=cursor)),
            "parked runs of one agent": _time(args.repeat, lambda: client.runs(agent="agent-1", state="parked")),
            "counts by state": _time(args.repeat, client.store.count_runs),
            "list view": _time(args.repeat, lambda: http.get("/ui/runs").raise_for_status()),
        }
        for name, times in figures.items():
            print(_figure(name, times))
    finally:
        client.close()
        engine.dispose()
    print("counts by state: " + ", ".join(f"{state} {n}" for state, n in counted.items()))
    return 0 if counted == {state: n for state, n in expected.items() if n} else 1


if __name__ == "__main__":
    sys.exit(main())
