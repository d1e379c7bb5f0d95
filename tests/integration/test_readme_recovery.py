"""The README's example of a tool that stops the run, run as written: the agent module and the two lines that send
and wait, on the real services, with the steps taken in this process and stand-ins for the payment and carrier
systems the example calls."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from producer.client import Client
from tests.support.driver import Driver
from worker import Agent

README = Path(__file__).resolve().parents[2] / "README.md"
_SECTION = "**When a tool stops the run.**"
_PYTHON = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)


class _Payments:
    def __init__(self) -> None:
        self.keys: list[str] = []

    def charge(self, order: int, idempotency_key: str) -> str:
        self.keys.append(idempotency_key)
        return f"charged order {order}"


class _Carrier:
    """Down the first time it is asked, up after."""

    def __init__(self) -> None:
        self.asked = 0
        self.shipped: list[int] = []

    def available(self) -> bool:
        self.asked += 1
        return self.asked > 1

    def ship(self, order: int) -> str:
        self.shipped.append(order)
        return f"shipped order {order}"


def _example() -> tuple[str, str]:
    text = README.read_text(encoding="utf-8")
    assert _SECTION in text, "the README has no example of a tool that stops the run"
    module, use = _PYTHON.findall(text[text.index(_SECTION) :])[:2]
    return module, use


def test_the_readme_example_of_a_tool_that_stops_the_run_runs_as_written(
    make_driver: Callable[..., Driver], client: Client, capsys: Any
) -> None:
    module_code, use_code = _example()
    payments, carrier = _Payments(), _Carrier()
    module: dict[str, Any] = {"payments": payments, "carrier": carrier}
    exec(compile(module_code, "README.md (agent module)", "exec"), module)
    orders = module["orders"]
    assert isinstance(orders, Agent)
    driver = make_driver(orders)
    send, wait = use_code.strip().splitlines()
    scope: dict[str, Any] = {"client": client}
    exec(compile(send, "README.md (send)", "exec"), scope)
    # The workers' part: the steps, retries included (their countdowns are not waited for here)
    driver.drain("order-7")
    exec(compile(wait, "README.md (wait)", "exec"), scope)
    printed = capsys.readouterr().out.strip()
    print(
        f"README example printed {printed!r}; charges {len(payments.keys)}, carrier asked {carrier.asked} times,"
        f" outcomes {[o.value for o in driver.outcomes]}"
    )
    assert printed == "Order charged and shipped."
    assert len(payments.keys) == 1 and carrier.asked == 2 and carrier.shipped == [7]
    assert "failed" in [o.value for o in driver.outcomes]  # the stop was a retry, not a park
