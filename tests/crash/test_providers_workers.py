"""``OpenAIModel`` runs under real ``celery worker`` processes, including kills around the model turn's save.

The worker imports ``tests.support.provider_agents``, whose model talks to the fake server of this test
process. A kill right after the provider answered and before the save costs one regenerated turn;
a kill after the save costs none. The killed answer's usage still counts.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes.provider_server import Call, FakeProviderServer, Turn, by_turn
from tests.support.cluster import Cluster
from tests.support.provider_agents import URL_ENV

pytestmark = [pytest.mark.crash, pytest.mark.usefixtures("no_real_providers")]

AGENT = "provider-weather"
PLAIN, KILLED_BEFORE_SAVE, KILLED_AFTER_SAVE = "provider-plain-1", "provider-before-save-1", "provider-after-save-1"


@pytest.fixture
def cluster(tmp_path: Path, server: FakeProviderServer) -> Iterator[Cluster]:
    """A worker (and the recover sweep) whose agents call the fake server; every process killed at the end."""
    made = Cluster(
        tmp_path / "cluster",
        crash_at=f"after_model_response_before_save:{KILLED_BEFORE_SAVE},"
        f"after_model_save_before_enqueue:{KILLED_AFTER_SAVE}",
        extra_env={"LOUSHO_AGENTS": "tests.support.provider_agents", URL_ENV: server.openai_url},
    )
    try:
        yield made
    except BaseException:
        made.dump_logs()
        raise
    finally:
        made.close()


def test_real_workers_finish_three_turn_runs_and_regenerate_a_turn_only_when_killed_before_its_save(
    cluster: Cluster, server: FakeProviderServer
) -> None:
    server.script = by_turn(
        Turn(calls=(Call("lookup", {"city": "Oslo"}), Call("lookup", {"city": "Rome"})), input_tokens=100),
        Turn(calls=(Call("lookup", {"city": "Lima"}),), input_tokens=150),
        Turn(text="Sunny everywhere.", input_tokens=200),
    )
    cluster.start_worker(concurrency=2)
    cluster.start_beat()
    runs = [PLAIN, KILLED_BEFORE_SAVE, KILLED_AFTER_SAVE]
    for session_id in runs:
        cluster.send(AGENT, session_id, f"Weather for {session_id}")

    cluster.wait_finished(runs, timeout=30)

    for session_id in runs:
        checkpoint = cluster.client.store.load(session_id)
        assert checkpoint is not None and checkpoint.final_text == "Sunny everywhere." and checkpoint.step == 3
        assert [m.role for m in checkpoint.messages].count("tool") == 3
    fired = {fault.runs[0] for fault in cluster.crash_faults()}
    assert fired == {KILLED_BEFORE_SAVE, KILLED_AFTER_SAVE}
    turns_asked = {sid: [r.assistant_turns for r in server.requests_for(f"Weather for {sid}")] for sid in runs}
    assert sorted(turns_asked[PLAIN]) == [0, 1, 2]
    # The first answer died with its worker before the save: asked again, once.
    assert sorted(turns_asked[KILLED_BEFORE_SAVE]) == [0, 0, 1, 2]
    # Once saved, an answer is never asked for again.
    assert sorted(turns_asked[KILLED_AFTER_SAVE]) == [0, 1, 2]
    # The provider billed the lost answer too: its usage still counts.
    usage = {sid: cluster.client.store.load(sid).usage.input_tokens for sid in runs}  # type: ignore[union-attr]
    assert usage == {PLAIN: 450, KILLED_BEFORE_SAVE: 550, KILLED_AFTER_SAVE: 450}
