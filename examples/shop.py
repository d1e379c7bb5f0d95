"""The demo shop agent: three model turns, the first asking for two tools at once.

When ``LOUSHO_DEMO_LOG`` names a file, every tool start and end is appended to it (one line per
write, so the lines survive a killed worker) for the demo's timeline.
"""

from __future__ import annotations

import json
import os
import time

from worker import Agent, ToolContext, tool
from worker.providers import MockModel


def _log(event: str, ctx: ToolContext, name: str) -> None:
    path = os.environ.get("LOUSHO_DEMO_LOG")
    if not path:
        return
    line = (
        json.dumps(
            {
                "ts": time.time(),
                "pid": os.getpid(),
                "event": event,
                "tool": name,
                "tool_call_id": ctx.tool_call_id,
                "session_id": ctx.session_id,
            }
        )
        + "\n"
    )
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


@tool
def charge(amount: float, ctx: ToolContext) -> str:
    """Charge the customer's card (idempotent on the tool call id)."""
    _log("start", ctx, "charge")
    time.sleep(float(os.environ.get("LOUSHO_DEMO_CHARGE_S", "0.2")))
    _log("end", ctx, "charge")
    return f"charged {amount:.2f} with idempotency key {ctx.tool_call_id}"


@tool
def reserve_stock(sku: str, ctx: ToolContext, quantity: int = 1) -> dict[str, object]:
    """Reserve items in the warehouse."""
    _log("start", ctx, "reserve_stock")
    time.sleep(0.2)
    _log("end", ctx, "reserve_stock")
    return {"sku": sku, "reserved": quantity}


@tool
def ship(order_id: str, ctx: ToolContext) -> str:
    """Hand the order to the carrier."""
    _log("start", ctx, "ship")
    time.sleep(0.1)
    _log("end", ctx, "ship")
    return f"order {order_id} shipped"


shop = Agent(
    name="shop",
    model=MockModel(
        [
            {
                "tool_calls": [
                    {"name": "reserve_stock", "args": {"sku": "tea", "quantity": 2}},
                    {"name": "charge", "args": {"amount": 5}},
                ]
            },
            {"tool_calls": [{"name": "ship", "args": {"order_id": "7"}}]},
            "Reserved, charged and shipped order 7.",
        ]
    ),
    instructions="You run a small shop.",
    tools=[charge, reserve_stock, ship],
    max_steps=10,
    tool_concurrency=4,
)
