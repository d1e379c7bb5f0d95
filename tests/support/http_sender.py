"""A webhook sender for the storm test, run as its own process so it does not share the receiver's interpreter.

Reads ``[{"id", "body" (base64), "headers"}, ...]`` on stdin, sends them in order from ``connections``
concurrent workers (each over its own keep-alive connection), and prints one JSON list of
``{"id", "status", "body", "elapsed"}`` on stdout. It stops after ``--timeout`` seconds whatever happens.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
import time
from typing import Any


async def _send(base: str, plan: list[dict[str, Any]], connections: int, timeout: float) -> list[dict[str, Any]]:
    import httpx2 as httpx

    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for item in plan:
        queue.put_nowait(item)
    results: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=timeout) as client:

        async def worker() -> None:
            while not queue.empty():
                item = queue.get_nowait()
                started = time.perf_counter()
                response = await client.post(
                    item["path"], content=base64.b64decode(item["body"]), headers=item["headers"]
                )
                elapsed = time.perf_counter() - started
                body = response.json() if response.headers.get("content-type") == "application/json" else None
                results.append({"id": item["id"], "status": response.status_code, "body": body, "elapsed": elapsed})

        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(connections))), timeout)
    return results


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("base")
    parser.add_argument("--connections", type=int, default=50)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    plan = json.load(sys.stdin)
    print(json.dumps(asyncio.run(_send(args.base, plan, args.connections, args.timeout))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
