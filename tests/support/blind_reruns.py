"""A deliberately broken build for a negative control of I18: ``once`` calls run again without reconciling.

Loaded into worker processes through ``LOUSHO_AGENTS`` (next to ``tests.support.agents``) when a test wants a
worker that treats a ``once`` call found started without a result as any other tool does: it runs it again.
A call killed after its effect then takes effect twice, and the checker must say so; if it does not, it can no
longer see this class of bug and the test fails. Nothing outside the tests imports this module.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from store.records import ToolCall
from worker import once
from worker.agents import Agent, ToolContext

ENV = "LOUSHO_TEST_BLIND_RERUNS"


def _blind(agent: Agent, call: ToolCall, context: ToolContext, retry_spent: Callable[[], float | None]) -> once.Rerun:
    return once.Rerun(call, None, ())


if os.environ.get(ENV):
    once.reconcile = _blind  # the broken build, on purpose
