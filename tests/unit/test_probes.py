"""The worker's liveness heartbeat and the probe commands Kubernetes runs (worker/probes.py)."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import kombu
import pytest

from worker import probes

#: kombu's classes are untyped: the tests use them through this name.
_kombu: Any = kombu


class Ticks:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _state(
    *, connected: bool = True, free_slots: int = 1, waiting: int = 0, asked: list[int] | None = None
) -> probes.ConsumerState:
    def count() -> int:
        if asked is not None:
            asked.append(waiting)
        return waiting

    return probes.ConsumerState(connected=connected, free_slots=free_slots, waiting=count)


@pytest.fixture
def clock() -> Ticks:
    return Ticks()


@pytest.fixture
def heartbeat(tmp_path: Path, clock: Ticks) -> probes.Heartbeat:
    return probes.Heartbeat(tmp_path / "heartbeat", stall_s=60.0, clock=clock)


def _age(path: Path) -> float:
    return time.time() - path.stat().st_mtime


def _make_old(path: Path, seconds: float = 600.0) -> None:
    old = time.time() - seconds
    os.utime(path, (old, old))


# -- the heartbeat rule ---------------------------------------------------------------------------------------


def test_a_busy_worker_touches_the_file_without_counting_queues(heartbeat: probes.Heartbeat) -> None:
    asked: list[int] = []

    assert heartbeat.beat(_state(free_slots=0, waiting=50, asked=asked))

    assert _age(heartbeat.path) < 5
    assert asked == []


def test_an_idle_worker_with_empty_queues_touches_the_file(heartbeat: probes.Heartbeat, clock: Ticks) -> None:
    for _ in range(10):
        clock.now += 30
        assert heartbeat.beat(_state(free_slots=4, waiting=0))


def test_a_worker_without_a_broker_connection_stops_touching(heartbeat: probes.Heartbeat) -> None:
    heartbeat.beat(_state())
    _make_old(heartbeat.path)

    assert not heartbeat.beat(_state(connected=False))

    assert _age(heartbeat.path) > 500


def test_messages_waiting_past_the_stall_time_with_a_free_slot_stop_the_touches(
    heartbeat: probes.Heartbeat, clock: Ticks
) -> None:
    # Given messages in the worker's queues, a free pool process, and nothing received
    assert heartbeat.beat(_state(waiting=3))
    clock.now += 59
    assert heartbeat.beat(_state(waiting=3))
    _make_old(heartbeat.path)

    # When they have waited for the stall time
    clock.now += 1

    # Then the file is no longer touched, and stays untouched while nothing arrives
    assert not heartbeat.beat(_state(waiting=3))
    clock.now += 10
    assert not heartbeat.beat(_state(waiting=1))
    assert _age(heartbeat.path) > 500


def test_a_received_message_restarts_the_stall_clock(heartbeat: probes.Heartbeat, clock: Ticks) -> None:
    heartbeat.beat(_state(waiting=3))
    clock.now += 50
    heartbeat.received()
    clock.now += 50

    assert heartbeat.beat(_state(waiting=3))
    clock.now += 59
    assert heartbeat.beat(_state(waiting=3))
    clock.now += 1
    assert not heartbeat.beat(_state(waiting=3))


def test_the_touches_resume_once_the_queues_drain_or_the_slots_fill(heartbeat: probes.Heartbeat, clock: Ticks) -> None:
    heartbeat.beat(_state(waiting=3))
    clock.now += 61
    assert not heartbeat.beat(_state(waiting=3))

    assert heartbeat.beat(_state(waiting=0))
    clock.now += 61
    assert heartbeat.beat(_state(waiting=3))
    clock.now += 61
    assert not heartbeat.beat(_state(waiting=3))
    assert heartbeat.beat(_state(free_slots=0, waiting=3))


def test_an_unwritable_file_counts_as_not_touched(tmp_path: Path) -> None:
    heartbeat = probes.Heartbeat(tmp_path / "missing-folder" / "heartbeat")

    assert not heartbeat.beat(_state())


# -- reading a Celery consumer --------------------------------------------------------------------------------


@pytest.fixture
def memory_broker() -> Iterator[Any]:
    connection = _kombu.Connection("memory://")
    yield connection
    connection.release()


def _consumer(connection: Any, queues: list[str], processes: int = 2) -> Any:
    """What probes reads of Celery's consumer, built from real kombu objects on the in-memory transport."""
    task_consumer = _kombu.Consumer(
        connection.default_channel, queues=[_kombu.Queue(name) for name in queues], accept=["json"]
    )
    task_consumer.declare()
    timer = SimpleNamespace(entries=[])
    timer.call_repeatedly = lambda seconds, fun: timer.entries.append((seconds, fun))
    return SimpleNamespace(
        connection=connection, task_consumer=task_consumer, timer=timer, pool=SimpleNamespace(num_processes=processes)
    )


def _publish(connection: Any, queue: str, count: int) -> None:
    with connection.Producer() as producer:
        for _ in range(count):
            producer.publish({"session_id": "r"}, routing_key=queue, serializer="json")


def test_the_consumer_state_counts_ready_messages_in_every_consumed_queue(memory_broker: Any) -> None:
    steps, starts = f"steps-{uuid.uuid4().hex}", f"starts-{uuid.uuid4().hex}"
    consumer = _consumer(memory_broker, [steps, starts], processes=4)
    _publish(memory_broker, steps, 2)
    _publish(memory_broker, starts, 1)
    _publish(memory_broker, f"other-{uuid.uuid4().hex}", 5)

    state = probes.consumer_state(consumer, reserved=lambda: 1)

    assert state.connected
    assert state.free_slots == 3
    assert state.waiting() == 3


def test_a_queue_the_broker_does_not_know_counts_as_empty(memory_broker: Any) -> None:
    steps = f"steps-{uuid.uuid4().hex}"
    consumer = _consumer(memory_broker, [steps])
    _publish(memory_broker, steps, 2)
    # An empty Redis list does not exist: a passive declare of its queue fails as "not found".
    unknown = _kombu.Queue(f"never-declared-{uuid.uuid4().hex}")
    consumer.task_consumer = SimpleNamespace(
        queues=[unknown, *consumer.task_consumer.queues], channel=consumer.task_consumer.channel
    )

    assert probes.consumer_state(consumer, reserved=lambda: 0).waiting() == 2


def test_a_consumer_between_connections_is_not_connected(memory_broker: Any) -> None:
    consumer = _consumer(memory_broker, [f"steps-{uuid.uuid4().hex}"])
    consumer.connection = None

    state = probes.consumer_state(consumer, reserved=lambda: 0)

    assert not state.connected


def test_watch_beats_at_once_then_from_the_consumer_timer(memory_broker: Any, tmp_path: Path, clock: Ticks) -> None:
    queue = f"steps-{uuid.uuid4().hex}"
    consumer = _consumer(memory_broker, [queue], processes=1)
    heartbeat = probes.Heartbeat(tmp_path / "heartbeat", stall_s=60.0, clock=clock)

    probes.watch(consumer, heartbeat, reserved=lambda: 0, interval_s=10.0)

    assert heartbeat.path.exists()
    [(seconds, tick)] = consumer.timer.entries
    assert seconds == 10.0
    # A message that waits while the only process is free, and never arrives: the ticks stop touching the file.
    _publish(memory_broker, queue, 1)
    tick()
    _make_old(heartbeat.path)
    clock.now += 61
    tick()
    assert _age(heartbeat.path) > 500


# -- the commands ---------------------------------------------------------------------------------------------


def test_check_passes_on_a_fresh_file_and_fails_on_an_old_or_missing_one(tmp_path: Path) -> None:
    path = tmp_path / "heartbeat"
    assert probes.main(["check", "--file", str(path)]) == 1
    path.touch()
    assert probes.main(["check", "--file", str(path), "--max-age", "60"]) == 0
    _make_old(path, 61)
    assert probes.main(["check", "--file", str(path), "--max-age", "60"]) == 1
    assert probes.main(["check", "--file", str(path), "--max-age", "120"]) == 0


def test_check_reads_the_file_from_the_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "heartbeat"
    path.touch()
    monkeypatch.setenv("LOUSHO_HEARTBEAT_FILE", str(path))
    assert probes.main(["check"]) == 0

    monkeypatch.delenv("LOUSHO_HEARTBEAT_FILE")
    assert probes.main(["check"]) == 2


@pytest.mark.parametrize(
    ("current", "ready"),
    [
        (set(), False),  # nothing migrated yet
        ({"0009"}, False),  # an older schema
        ({"0010"}, True),  # this release's
        ({"0099"}, True),  # a newer release's (schema changes only add: a rollback runs on it)
    ],
)
def test_the_schema_is_ready_at_this_release_or_a_newer_one(current: set[str], ready: bool) -> None:
    assert probes.schema_ready(current, "0010", known={"0001", "0009", "0010"}) is ready


def _revisions(result: tuple[set[str], str, set[str]] | Exception) -> Callable[[Any], tuple[set[str], str, set[str]]]:
    def read(_: Any) -> tuple[set[str], str, set[str]]:
        if isinstance(result, Exception):
            raise result
        return result

    return read


def test_schema_passes_when_migrated_and_gives_up_after_its_wait(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from sqlalchemy.exc import OperationalError

    monkeypatch.setattr(probes, "_schema_revisions", _revisions(({"0010"}, "0010", {"0010"})))
    assert probes.main(["schema"]) == 0

    monkeypatch.setattr(probes, "_schema_revisions", _revisions(({"0009"}, "0010", {"0009", "0010"})))
    assert probes.main(["schema", "--wait", "0"]) == 1
    assert "lousho migrate" in capsys.readouterr().err

    monkeypatch.setattr(probes, "_schema_revisions", _revisions(OperationalError("SELECT", {}, Exception("down"))))
    assert probes.main(["schema", "--wait", "0"]) == 1
    assert "cannot be read yet" in capsys.readouterr().err
