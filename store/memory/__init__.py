"""In-memory checkpoint store, approvals and run leases, for the unit tests of the step machine only.

The product always runs on Postgres (``store.checkpoints``, ``store.approvals``) and Redis
(``store.leases``). These mirror their semantics (fence claims, seq, history ring, inbox, attempts,
decisions, fencing tokens) and are held to the same contract suites, with an injectable clock so lease
expiry and staleness are simulated without sleeping.
"""

from __future__ import annotations

from store.memory.approvals import MemoryApprovalStore
from store.memory.checkpoints import MemoryCheckpointStore
from store.memory.leases import MemoryLeaseManager
from store.memory.model_slots import MemoryModelSlots
from store.memory.state import Clock, MemoryState

__all__ = [
    "Clock",
    "MemoryApprovalStore",
    "MemoryCheckpointStore",
    "MemoryLeaseManager",
    "MemoryModelSlots",
    "MemoryState",
]
