"""Every store implementation satisfies its port in ``store.interfaces``, so the ports and the stores cannot drift.

Checked twice: mypy checks the assignments typed as the ports below, and at run time every member of a
port must exist on each implementation with the same parameters, defaults and resolved annotations.
Nothing here connects: engines and Redis clients connect on first use only.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from sqlalchemy import create_engine

import store.model_limit
import store.schedules
from store import interfaces
from store.approvals import PostgresApprovalStore
from store.checkpoints import PostgresCheckpointStore
from store.deliveries import PostgresDeliveryStore
from store.leases import Heartbeat, LeaseManager
from store.memory import MemoryApprovalStore, MemoryCheckpointStore, MemoryLeaseManager, MemoryModelSlots
from store.model_slots import RedisModelSlots
from store.registry import PostgresAgentRegistry
from store.schedules import PostgresScheduleStore
from tests.fakes.heartbeat import NullHeartbeat

#: (port, implementation): every implementation of a port that the product or the unit tier uses.
IMPLEMENTATIONS: list[tuple[type, type]] = [
    (interfaces.CheckpointStore, PostgresCheckpointStore),
    (interfaces.CheckpointStore, MemoryCheckpointStore),
    (interfaces.ApprovalStore, PostgresApprovalStore),
    (interfaces.ApprovalStore, MemoryApprovalStore),
    (interfaces.Leases, LeaseManager),
    (interfaces.Leases, MemoryLeaseManager),
    (interfaces.ModelSlots, RedisModelSlots),
    (interfaces.ModelSlots, MemoryModelSlots),
    (interfaces.Heartbeat, Heartbeat),
    (interfaces.Heartbeat, NullHeartbeat),
    (interfaces.AgentRegistry, PostgresAgentRegistry),
    (interfaces.DeliveryStore, PostgresDeliveryStore),
    (interfaces.ScheduleStore, PostgresScheduleStore),
]

# The schedule records are imported by ``store.interfaces`` for type checking only.
_PORT_NAMES = {**vars(store.schedules), **vars(store.model_limit), **vars(interfaces)}


def _methods(port: type) -> Iterator[str]:
    """The public methods a port declares, its bases' included."""
    seen: set[str] = set()
    for base in port.__mro__:
        if base in (object, typing.Protocol, typing.Generic):
            continue
        for name, member in vars(base).items():
            if not name.startswith("_") and callable(member) and name not in seen:
                seen.add(name)
                yield name


def _shape(function: Callable[..., Any], names: dict[str, Any] | None = None) -> list[tuple[str, Any, Any, Any]]:
    """Each parameter's name, kind, default and resolved annotation, then the resolved return annotation."""
    hints = typing.get_type_hints(function, globalns=names)
    shape = [(p.name, p.kind, p.default, hints.get(p.name)) for p in inspect.signature(function).parameters.values()]
    return [*shape, ("return", None, None, hints.get("return"))]


@pytest.mark.parametrize(
    ("port", "implementation"),
    IMPLEMENTATIONS,
    ids=[f"{impl.__name__}-{port.__name__}" for port, impl in IMPLEMENTATIONS],
)
def test_an_implementation_offers_every_method_of_its_port_with_the_same_signature(
    port: type, implementation: type
) -> None:
    methods = list(_methods(port))
    assert methods, f"{port.__name__} declares no method"
    for name in methods:
        assert hasattr(implementation, name), f"{implementation.__name__} lacks {name}"
        expected = _shape(getattr(port, name), _PORT_NAMES)
        actual = _shape(getattr(implementation, name))
        assert actual == expected, f"{implementation.__name__}.{name} differs from {port.__name__}.{name}"


def test_every_implementation_is_typed_as_its_port() -> None:
    # Given one instance of each implementation (nothing connects before first use)
    engine = create_engine("postgresql+psycopg://")
    client = redis.Redis()
    memory = MemoryCheckpointStore()
    leases = LeaseManager(client, 1000)
    # When each is held as its port (mypy checks these assignments: a drift fails the type check)
    checkpoints: list[interfaces.CheckpointStore] = [PostgresCheckpointStore(engine), memory]
    approvals: list[interfaces.ApprovalStore] = [PostgresApprovalStore(engine), MemoryApprovalStore(memory)]
    lease_managers: list[interfaces.Leases] = [leases, MemoryLeaseManager(1000)]
    heartbeats: list[interfaces.Heartbeat] = [Heartbeat(leases, 500), NullHeartbeat()]
    slots: list[interfaces.ModelSlots] = [RedisModelSlots(client, 1000), MemoryModelSlots(1000)]
    registries: list[interfaces.AgentRegistry] = [PostgresAgentRegistry(engine)]
    deliveries: list[interfaces.DeliveryStore] = [PostgresDeliveryStore(engine)]
    schedules: list[interfaces.ScheduleStore] = [PostgresScheduleStore(engine)]
    # Then every port has its implementations, and the leases carry their TTL
    implemented = [checkpoints, approvals, lease_managers, heartbeats, slots, registries, deliveries, schedules]
    assert all(implemented)
    assert [manager.ttl_ms for manager in lease_managers] == [1000, 1000]
    assert [keeper.ttl_ms for keeper in slots] == [1000, 1000]
    client.close()
    engine.dispose()
