"""``desk`` of ``tests.support.local_agents`` in a later release: its second answer differs (replays diverge there)."""

from __future__ import annotations

from tests.support import local_agents
from worker.providers import MockModel

#: What the changed agent answers at its second turn.
CHANGED = "It rains in Oslo."

desk = local_agents.desk.replace(model=MockModel([local_agents.FIRST, {"text": CHANGED}]))
