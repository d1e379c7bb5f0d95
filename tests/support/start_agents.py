"""Agents and beat entries for the tests of starting runs from Celery (``tests/crash/test_celery_starts.py``).

Workers import this module through ``LOUSHO_AGENTS=tests.support.start_agents``; a beat reads its
``beat_schedule`` through ``LOUSHO_BEAT_MODULES=tests.support.start_agents``: ``ticks`` (built by ``beat_entry``,
every ``TICK_S`` seconds on the epoch's grid) and ``plain`` (an ordinary entry naming the task).
"""

from __future__ import annotations

from typing import Any

from store.settings import load_settings
from worker import Agent
from worker.providers import MockModel
from worker.starts import START_TASK, beat_entry, start_queue

AGENT = "starter"
TICK_S = 5.0
PLAIN_S = 7.0

starter = Agent(name=AGENT, model=MockModel(lambda messages: f"started by: {messages[-1].content}"))

_queue = load_settings().queue
beat_schedule: dict[str, dict[str, Any]] = {
    "ticks": beat_entry("ticks", AGENT, "the tick's job", TICK_S, queue=_queue),
    "plain": {
        "task": START_TASK,
        "schedule": PLAIN_S,
        "kwargs": {"agent": AGENT, "input": "a plain entry"},
        "options": {"queue": start_queue(_queue)},
    },
}
