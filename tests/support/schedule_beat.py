"""A stand-in for ``celery beat`` + the ``lousho.schedules`` task, run as its own process by the beats test.

Calls ``worker.schedules.sweep`` every ``--interval`` seconds until ``--duration`` passes (or it is
killed) and prints one JSON line per sweep: ``{"beat", "started" (the database's time), "fired": [session ids],
"skipped", "missed"}``.
It uses the database named by ``LOUSHO_DATABASE_URL``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timedelta

from sqlalchemy import text

from store.database import make_engine
from store.schedules import PostgresScheduleStore
from store.settings import Settings
from worker.schedules import sweep


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--grace", type=float, default=60.0)
    args = parser.parse_args()
    engine = make_engine(Settings())
    store = PostgresScheduleStore(engine)
    print(json.dumps({"beat": args.name, "ready": True}), flush=True)
    deadline = time.monotonic() + args.duration
    next_at = time.monotonic()
    while time.monotonic() < deadline:
        with engine.connect() as conn:
            started: datetime = conn.execute(text("SELECT now()")).scalar_one()
        result = sweep(store, grace=timedelta(seconds=args.grace))
        print(
            json.dumps(
                {
                    "beat": args.name,
                    "started": started.isoformat(),
                    "fired": result.session_ids,
                    "skipped": result.skipped,
                    "missed": result.missed,
                }
            ),
            flush=True,
        )
        next_at += args.interval
        time.sleep(max(0.0, next_at - time.monotonic()))
    engine.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
