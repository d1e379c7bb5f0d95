"""Starting runs from Celery with real ``celery worker`` and ``celery beat`` processes: two beats sending an entry
made by ``beat_entry`` start one run per tick; a plain ``beat_schedule`` entry starts one run per message; the
entries reach ``celery -A worker beat`` through ``LOUSHO_BEAT_MODULES`` and a team's beat from its own app after
``install(app)``; a second Celery app that knows only the task's name starts a run, and a message delivered twice
starts it once."""

from __future__ import annotations

import itertools
import re
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime

import psycopg
import pytest
from celery import Celery

from store import errors
from tests.support import services
from tests.support.cluster import Cluster, wait_until
from tests.support.flower_ui import EventTap
from tests.support.start_agents import AGENT, PLAIN_S, TICK_S
from worker.starts import START_TASK, start_queue

MODULE = "tests.support.start_agents"
WINDOW_S = 20.0


def _runs(cluster: Cluster, prefix: str) -> dict[str, tuple[str, int]]:
    """Run id -> (status, inputs) of the runs whose id starts with ``prefix``."""
    with psycopg.connect(cluster.database_url) as conn:
        rows = conn.execute(
            "SELECT session_id, status, inbox_head FROM runs WHERE left(session_id, %s) = %s", (len(prefix), prefix)
        ).fetchall()
    return {row[0]: (row[1], int(row[2])) for row in rows}


def _sent(cluster: Cluster, entry: str) -> int:
    """How many messages the beats sent for ``entry``."""
    return sum(path.read_text().count(f"Sending due task {entry} ") for path in cluster.workdir.glob("beat-*.log"))


def test_two_beats_start_one_run_per_tick_and_a_plain_entry_one_run_per_message(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = make_cluster(extra_env={"LOUSHO_AGENTS": MODULE, "LOUSHO_BEAT_MODULES": MODULE})
    cluster.start_worker(concurrency=2)
    began = time.time()
    cluster.start_beat()
    time.sleep(TICK_S / 2 + 0.3)  # the second beat runs on another phase: its own timer, the same grid
    cluster.start_beat()
    time.sleep(WINDOW_S)
    for beat in cluster.beats:
        beat.kill()
        beat.wait(10)
    ended = time.time()
    wait_until(
        lambda: (
            all(status == "finished" for status, _ in _runs(cluster, "ticks-").values())
            and all(status == "finished" for status, _ in _runs(cluster, "task-").values())
        ),
        30,
        "runs finished",
    )

    ticks = _runs(cluster, "ticks-")
    times = sorted(datetime.strptime(run_id.removeprefix("ticks-"), "%Y%m%dT%H%M%S").timestamp() for run_id in ticks)
    expected = int(ended // TICK_S) - int(began // TICK_S)
    steps = {round(b - a) for a, b in itertools.pairwise(times)}
    twice = [run_id for run_id, (_, inputs) in ticks.items() if inputs != 1]
    plain = _runs(cluster, "task-")
    print(
        f"\n[beat ticks] {WINDOW_S:.0f} s, two beats: {_sent(cluster, 'ticks')} messages sent for {len(ticks)} tick"
        f" run(s) ({expected} grid points in the window), {len(twice)} run(s) started twice, gaps {sorted(steps)};"
        f" plain entry: {_sent(cluster, 'plain')} messages, {len(plain)} run(s)"
    )
    assert twice == []
    assert steps <= {int(TICK_S)}  # consecutive ticks: none missing inside the window
    assert expected - 2 <= len(ticks) <= expected  # at most one tick missing at each edge
    assert _sent(cluster, "ticks") >= 2 * (len(ticks) - 2)  # both beats sent (almost) every tick
    assert len(plain) == _sent(cluster, "plain") >= 2 * int(WINDOW_S // PLAIN_S) - 2
    assert all(inputs == 1 for _, inputs in plain.values())


def test_lousho_s_beat_reads_the_beat_modules_and_a_team_s_beat_keeps_its_own_entries(
    make_cluster: Callable[..., Cluster],
) -> None:
    url = services.test_redis_url()
    cluster = make_cluster(
        extra_env={
            "LOUSHO_AGENTS": MODULE,
            "LOUSHO_BEAT_MODULES": MODULE,
            "HOST_APP_REDIS_URL": url,
            "LOUSHO_BROKER_URL": url,
        }
    )
    cluster.start_worker(concurrency=2)

    cluster.start_beat()  # celery -A worker beat
    cluster.start_beat(app="tests.support.host_app")  # the team's beat, after install(app)

    wait_until(
        lambda: (
            any(status == "finished" for status, _ in _runs(cluster, "ticks-").values())
            and any(status == "finished" for status, _ in _runs(cluster, "host-ticks-").values())
        ),
        30,
        "a run of the beat module's entry and one of the team's own entry",
    )
    # The sweeps run next to the team's entries: the team's beat sends the recover sweep at its own interval, which
    # may come after the first tick's run finished.
    wait_until(
        lambda: "Sending due task lousho-recover " in (cluster.workdir / "beat-2.log").read_text(errors="replace"),
        30,
        "the team's beat sending the recover sweep",
    )
    lousho_beat = (cluster.workdir / "beat-1.log").read_text(errors="replace")
    team_beat = (cluster.workdir / "beat-2.log").read_text(errors="replace")
    assert "Sending due task ticks " in lousho_beat and "Sending due task host-ticks " not in lousho_beat
    assert "Sending due task host-ticks " in team_beat


def test_a_second_celery_app_that_knows_only_the_task_name_starts_a_run_once_per_message(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = make_cluster(extra_env={"LOUSHO_AGENTS": MODULE})
    cluster.start_worker(concurrency=1)
    settings = cluster.settings()
    other = Celery("elsewhere", broker=settings.broker)
    other.conf.update(task_serializer="json", accept_content=["json"])
    queue = start_queue(settings.queue)
    kwargs = {"agent": AGENT, "input": "from another app", "session_id": "elsewhere-1", "metadata": {"from": "x"}}
    other.send_task(START_TASK, kwargs=kwargs, queue=queue, task_id="delivery-1")
    other.send_task(START_TASK, kwargs=kwargs, queue=queue, task_id="delivery-1")  # the same message again
    other.send_task(START_TASK, kwargs={"agent": AGENT, "input": "no id given"}, queue=queue, task_id="delivery-2")
    cluster.wait_finished(["elsewhere-1", "task-delivery-2"], timeout=30)
    runs = {**_runs(cluster, "elsewhere-"), **_runs(cluster, "task-")}
    assert runs == {"elsewhere-1": ("finished", 1), "task-delivery-2": ("finished", 1)}
    checkpoint = cluster.checkpoint(AGENT, "elsewhere-1")
    assert checkpoint.final_text == "started by: from another app" and checkpoint.metadata == {"from": "x"}
    logged = Counter(re.findall(r"start: input \d+ of run (\S+) queued", cluster.worker_logs()))
    assert logged == {"elsewhere-1": 2, "task-delivery-2": 1}  # the second delivery found its input applied


def test_a_start_answers_its_run_id_and_a_refused_start_its_error_once(make_cluster: Callable[..., Cluster]) -> None:
    url = services.test_redis_url()
    cluster = make_cluster(extra_env={"LOUSHO_AGENTS": MODULE, "LOUSHO_RESULT_BACKEND": url})
    cluster.start_worker(concurrency=1)
    settings = cluster.settings()
    # A plain Celery app with a result backend, routing the task by name to the start queue (no queue= per call).
    caller = Celery("elsewhere", broker=settings.broker, backend=url, set_as_current=False)
    caller.conf.update(
        task_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        task_routes={START_TASK: {"queue": start_queue(settings.queue)}},
    )
    tap = EventTap()
    try:
        named = caller.send_task(START_TASK, kwargs={"agent": AGENT, "input": "answer me", "session_id": "answer-1"})
        unnamed = caller.send_task(START_TASK, kwargs={"agent": AGENT, "input": "and me"}, task_id="delivery-9")
        refused = caller.send_task(START_TASK, kwargs={"agent": "startr", "input": "a typo"})

        assert named.get(timeout=30) == "answer-1"
        assert unnamed.get(timeout=30) == "task-delivery-9"
        with pytest.raises(errors.AgentNotFoundError) as raised:
            refused.get(timeout=30)
        wait_until(
            lambda: any(e.get("type") == "task-failed" and e.get("uuid") == refused.id for e in tap.drain()),
            10,
            "the refused start's task-failed event",
        )
    finally:
        tap.close()
        caller.close()

    assert raised.value.code == "LOUSHO_AGENT_NOT_FOUND" and str(raised.value).count("unknown agent") == 1
    assert str(raised.value) == "unknown agent 'startr'; known agents: starter"
    failed = next(e for e in tap.events if e.get("type") == "task-failed" and e.get("uuid") == refused.id)
    print(f"\n[refused start] Flower shows: {failed['exception']}")
    assert failed["exception"] == "AgentNotFoundError(\"unknown agent 'startr'; known agents: starter\")"
    cluster.wait_finished(["answer-1", "task-delivery-9"], timeout=30)
