"""An example agent: three model turns, the first asking for two tools at once."""

from __future__ import annotations

import time

from worker import Agent, ToolContext, tool
from worker.providers import MockModel


@tool
def charge(amount: float, ctx: ToolContext) -> str:
    """Charge the customer's card."""
    time.sleep(0.2)
    return f"charged {amount:.2f} (key {ctx.tool_call_id})"


@tool
def reserve_stock(sku: str, quantity: int = 1) -> dict[str, object]:
    """Reserve items in the warehouse."""
    time.sleep(0.2)
    return {"sku": sku, "reserved": quantity}


@tool
def ship(order_id: str) -> str:
    """Hand the order to the carrier."""
    time.sleep(0.1)
    return f"order {order_id} shipped"


shop = Agent(
    name="shop",
    model=MockModel([
        {"tool_calls": [{"name": "charge", "args": {"amount": 5}},
                        {"name": "reserve_stock", "args": {"sku": "tea", "quantity": 2}}]},
        {"tool_calls": [{"name": "ship", "args": {"order_id": "7"}}]},
        "Charged, reserved and shipped order 7.",
    ]),
    instructions="You run a small shop.",
    tools=[charge, reserve_stock, ship],
    max_steps=10,
    tool_concurrency=4,
)
